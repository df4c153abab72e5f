"""In-process generation on one engine: plain decoding (no drafts) or speculative with a draft source."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specedge.cloud.engine import Engine
from specedge.common.draft_tree import DraftTree
from specedge.common.sampling import SamplingParams

DraftSource = Callable[[list[int]], DraftTree]  # committed token ids -> tree rooted at the last one


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only, up to and including an EOS token
    rounds: int  # forward passes, prefill included
    wall_s: float
    stopped_by: str  # "eos", "max_new_tokens" or "stop"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        return self.num_tokens / max(1, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


def generate(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: Iterable[int] = (),
    draft: DraftSource | None = None,
    stop: Callable[[list[int]], int | None] | None = None,
) -> GenerationResult:
    """Generate until an EOS id, `params.max_new_tokens`, or `stop(output_ids)` returns a cut length."""
    eos = set(eos_ids)
    start = time.perf_counter()
    seq = engine.add_sequence(prompt_ids, params)
    out: list[int] = []
    rounds, stopped_by = 0, "max_new_tokens"
    try:
        while len(out) < params.max_new_tokens:
            tree = draft(seq.token_ids) if draft is not None else DraftTree([], [])
            (verdict,) = engine.step([(seq, tree)])
            rounds += 1
            new = verdict.tokens[: params.max_new_tokens - len(out)]
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            if hit is not None:
                out.extend(new[: hit + 1])
                stopped_by = "eos"
                break
            out.extend(new)
            if stop is not None and (cut := stop(out)) is not None:
                del out[cut:]
                stopped_by = "stop"
                break
    finally:
        engine.release(seq)
    return GenerationResult(out, rounds, time.perf_counter() - start, stopped_by)
