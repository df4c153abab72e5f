"""The edge's generation loop: draft, let the verifier check, commit, repeat; the same loop for an
in-process verifier and a remote one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specedge.common.draft_tree import DraftTree
from specedge.common.session import VerifierSession
from specedge.edge.controller import TreeSizeController
from specedge.edge.drafter import Drafter


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only, up to and including an EOS token
    rounds: int  # verification passes, the one that prefills the prompt included
    wall_s: float
    stopped_by: str  # "eos", "max_new_tokens" or "stop"
    ttft_s: float = 0.0  # until the first pass (the prompt's prefill) returned
    draft_ms: list[float] = field(default_factory=list)  # per round
    tree_sizes: list[int] = field(default_factory=list)  # draft tokens sent per round

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per verification pass (the bonus token included)."""
        return self.num_tokens / max(1, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


def generate(
    session: VerifierSession,
    eos_ids: Iterable[int] = (),
    drafter: Drafter | None = None,
    controller: TreeSizeController | None = None,
    stop: Callable[[list[int]], int | None] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate until an EOS id, the session's `max_new_tokens`, or `stop(output_ids)` returns a cut length.

    The session is closed at the end. `on_tokens` sees each round's newly committed tokens (streaming).
    """
    params = session.params
    eos = set(eos_ids)
    start = time.perf_counter()
    out: list[int] = []
    result = GenerationResult([], 0, 0.0, "max_new_tokens")
    if drafter is not None:
        drafter.begin(session.prompt_ids, params)
    # A drafter that can use the verifier's time gets it: the step runs in a thread meanwhile.
    speculate = getattr(drafter, "speculate", None)
    waiting = ThreadPoolExecutor(1, thread_name_prefix="verdict") if speculate is not None else None
    try:
        while len(out) < params.max_new_tokens:
            t0 = time.perf_counter()
            tree = DraftTree.empty()
            if drafter is not None:
                draft = drafter.propose()
                size = len(draft)
                if controller is not None:
                    size = controller.choose(draft, session.cost_model(), params.max_new_tokens - len(out))
                tree = draft.prefix(min(size, session.max_tree_tokens))
            result.draft_ms.append((time.perf_counter() - t0) * 1e3)
            result.tree_sizes.append(len(tree))
            if speculate is not None and len(tree):
                verdict = waiting.submit(session.step, tree)
                speculate(verdict.done)
                step = verdict.result()
            else:
                step = session.step(tree)
            result.rounds += 1
            if result.rounds == 1:
                result.ttft_s = time.perf_counter() - start
            if drafter is not None:
                drafter.observe(tree, step)
            if controller is not None:
                controller.observe(tree, step)
            new = step.tokens[: params.max_new_tokens - len(out)]
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            if hit is not None:
                new = new[: hit + 1]
            out.extend(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if hit is not None:
                result.stopped_by = "eos"
                break
            if stop is not None and (cut := stop(out)) is not None:
                del out[cut:]
                result.stopped_by = "stop"
                break
    finally:
        if drafter is not None:
            drafter.end()
        if waiting is not None:
            waiting.shutdown()
        session.close()
    result.token_ids = out
    result.wall_s = time.perf_counter() - start
    return result
