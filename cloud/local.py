"""The in-process verifier: an engine behind the same session interface as a remote verifier."""

from __future__ import annotations

import time

from specedge.cloud.cost_tracker import CostTracker
from specedge.cloud.engine import Engine, Sequence
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult


class LocalSession:
    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, costs: CostTracker,
                 hints_top_k: int = 0, prompt_hints: bool = True) -> None:
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.max_tree_tokens = 1 << 30  # in this process, any tree is taken
        self.prompt_ids, self.params = list(prompt_ids), params
        self.seq: Sequence | None = engine.add_sequence(prompt_ids, params, hints_top_k, prompt_hints)
        self.costs = costs
        self._prefilled = False

    def step(self, tree: DraftTree) -> StepResult:
        if self.seq is None:
            raise RuntimeError("the session is closed")
        tree.validate(self.vocab_size)
        start = time.perf_counter()
        (verdict,) = self.engine.step([(self.seq, tree)])
        ms = (time.perf_counter() - start) * 1e3
        if self._prefilled:  # the first pass also prefills the prompt: not a verification cost
            self.costs.observe(len(tree), ms)
        self._prefilled = True
        return StepResult(tokens=verdict.tokens, accepted=verdict.accepted, compute_ms=ms, hints=verdict.hints,
                          prompt_hints=verdict.prompt_hints, prompt_hints_start=verdict.prompt_hints_start)

    def cost_model(self) -> CostModel:
        return self.costs.model()

    def close(self) -> None:
        if self.seq is not None:
            self.engine.release(self.seq)
            self.seq = None


class LocalVerifier:
    """Opens sessions on one engine; remembers the measured pass costs across sessions."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.costs = CostTracker.for_device(engine.device)

    def open(self, prompt_ids: list[int], params: SamplingParams, hints_top_k: int = 0,
             prompt_hints: bool = True) -> LocalSession:
        """`hints_top_k` > 0: every step's result carries the target's hints (common/hints.py), the first one
        also at the prompt's positions unless `prompt_hints` is off (no bytes to save in this process)."""
        return LocalSession(self.engine, prompt_ids, params, self.costs, hints_top_k, prompt_hints)
