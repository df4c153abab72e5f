"""What sessions ask of the verifier's scheduler, as typed values: each carries the future its caller (a
gRPC handler, on any thread) awaits, and the time it was asked, from which its queueing time is told."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from specedge.cloud.acceptance import Verdict
from specedge.cloud.engine import Sequence
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams


@dataclass
class StepOutcome:
    """What one engine step did for one session, and what the session should know for its next round."""

    verdict: Verdict
    tree_sent: int  # draft nodes actually verified (after trimming)
    queue_ms: float
    compute_ms: float
    cost: CostModel  # pass time by tree size for this session, at the load of this step
    active_sessions: int
    next_max_tree_tokens: int  # the largest tree a session gets untrimmed when every session sends one
    cached_prompt_tokens: int = 0  # for an open: prompt tokens whose KV came from the prefix cache


# eq=False: requests are told apart by identity (two sessions may ask the same thing).
@dataclass(eq=False)
class OpenRequest:
    """Prefill a prompt and verify a first tree with it; resolves to (the new Sequence, its outcome)."""

    prompt_ids: list[int]
    params: SamplingParams
    tree: DraftTree
    future: Future[tuple[Sequence, StepOutcome]] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    hints_top_k: int = 0  # the session's verdicts carry hints (common/hints.py)
    prompt_hints: bool = False  # the first also at the prompt's positions (cloud/prompt_hints.py)
    on_progress: Callable[[int, int], None] | None = None  # (prompt tokens with KV, prompt length) per chunk
    seq: Sequence | None = None  # once a prefill in chunks has started (the scheduler's to set)
    cached_prompt_tokens: int = 0  # found in the prefix cache when it started


@dataclass(eq=False)
class VerifyRequest:
    seq: Sequence
    tree: DraftTree
    future: Future[StepOutcome] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class CloseRequest:
    seq: Sequence
    future: Future[None] = field(default_factory=Future)


@dataclass(eq=False)
class FlushCacheRequest:
    """Forget the cached prefixes no sequence uses; resolves to how many blocks were forgotten."""

    future: Future[int] = field(default_factory=Future)


StepRequest = OpenRequest | VerifyRequest  # what an engine step serves
Request = OpenRequest | VerifyRequest | CloseRequest | FlushCacheRequest
