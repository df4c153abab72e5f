"""Planning one engine step: which waiting requests run, with how much of their draft trees, and which are
refused. A pure function of the waiting requests, the KV pool (only asked, never changed), the cost
model and the clock; the scheduler thread (cloud/scheduler.py) carries the plan out.

- Verifications go first: every session gets its own token, then draft nodes as far as their expected
  tokens are worth the step time they add at this load (common/tree_sizing.py), within the step's token
  budget (speculation must not make a loaded server slower than plain decoding), and shrunk to what the
  pool can hold now.
- Then prefills, with what is left of the budget; the step's first prefill gets at least a quarter of
  the budget even when the verifications took it all, so that prompts keep moving under load. A prompt
  longer than its share is prefilled in chunks over several steps (the last chunk with its tree), so that
  a long prompt never stalls the other sessions' rounds for its whole prefill; its KV blocks are taken at
  its first chunk. A prefill waits while another, started in this step or still under way, starts with
  the same block of tokens, so that it reuses that one's cached prefix instead of computing its own.
- KV admission answers fits / not now / never. A prompt that does not fit now waits while sessions give
  blocks back; it is refused only if it could never fit, or if no session has given blocks back for
  `admission_timeout_s` (the pool is held, not draining).
- When nothing can run because every waiting session needs blocks that only another's end could free,
  the youngest session is refused (at most once every `preempt_every_s`, leaving time for its close to
  arrive), so that the others finish; its client resumes it later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specedge.cloud.config import ServerConfig
from specedge.cloud.kv_pool import KVBlockPool, KVPoolExhausted
from specedge.cloud.requests import OpenRequest, StepRequest, VerifyRequest
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.tree_sizing import best_tree_size

RETRY_AFTER_S = 1.0  # told to a client whose request was refused for now, not for good
PREFILL_FLOOR = 4  # a step's first prefill may compute max_batch_tokens / PREFILL_FLOOR tokens beyond the budget


@dataclass(frozen=True)
class StepLimits:
    max_batch_tokens: int = ServerConfig.max_batch_tokens
    admission_timeout_s: float = ServerConfig.admission_timeout_s
    preempt_every_s: float = 1.0


@dataclass(frozen=True)
class PoolProgress:
    """When the pool last moved, by the scheduler's clock (time.perf_counter)."""

    last_release: float = 0.0  # a session gave its blocks back
    last_preempt: float = 0.0  # a session was refused to break a deadlock


@dataclass
class StepPlan:
    batch: list[tuple[StepRequest, DraftTree]] = field(default_factory=list)  # trees as trimmed for this step
    chunks: list[tuple[OpenRequest, int]] = field(default_factory=list)  # prefills that compute this many tokens
    refused: list[tuple[StepRequest, KVPoolExhausted]] = field(default_factory=list)
    preempted: bool = False  # one of `refused` was stopped to break a deadlock


def plan_step(waiting: list[StepRequest], pool: KVBlockPool, cost: CostModel, limits: StepLimits, now: float,
              progress: PoolProgress) -> StepPlan:
    plan = StepPlan()
    verifies = [r for r in waiting if isinstance(r, VerifyRequest)]
    budget = limits.max_batch_tokens
    free_blocks = pool.num_available()
    stuck = []
    for request, n in zip(verifies, tree_sizes(verifies, budget, cost)):
        seq = request.seq
        need = pool.blocks_needed(seq.seq_id, len(seq.token_ids) + n)
        while n > 0 and need > free_blocks:  # shrink the tree to what the pool can hold
            n //= 2
            need = pool.blocks_needed(seq.seq_id, len(seq.token_ids) + n)
        if need > free_blocks:
            stuck.append(request)  # not even its own token fits now: it waits for blocks to come back
            continue
        free_blocks -= need
        budget -= 1 + n
        plan.batch.append((request, request.tree.prefix(n)))
    first_blocks = set()
    first_chunk = True  # one prefill per step may take PREFILL_FLOOR of the budget whatever the verifies left
    opens = sorted((r for r in waiting if isinstance(r, OpenRequest)), key=lambda r: r.seq is None)  # started first
    for request in opens:
        head = tuple(request.prompt_ids[: pool.block_size])
        if request.seq is not None:  # a chunked prefill under way: its blocks are reserved
            left = len(request.seq.token_ids) - request.seq.num_cached
        else:
            if head in first_blocks and len(request.prompt_ids) > pool.block_size:
                continue  # let it reuse this step's prefill of the same prefix next step
            tokens = len(request.prompt_ids) + len(request.tree)
            if not pool.can_ever_hold(tokens):
                plan.refused.append((request, KVPoolExhausted(
                    f"KV pool full: the prompt needs {pool.blocks_for(tokens)} blocks of {pool.block_size} tokens, "
                    f"the pool has {pool.num_blocks}")))
                continue
            need = pool.blocks_to_open(request.prompt_ids, tokens)
            if need > free_blocks:
                if now - max(request.submitted, progress.last_release) > limits.admission_timeout_s:
                    plan.refused.append((request, KVPoolExhausted(
                        f"KV pool full: the prompt needs {need} blocks of {pool.block_size} tokens, {free_blocks} "
                        f"of {pool.num_blocks} free after waiting", retry_after_s=RETRY_AFTER_S)))
                continue
            left = len(request.prompt_ids) - pool.cached_prefix_tokens(request.prompt_ids)
        room = max(budget, limits.max_batch_tokens // PREFILL_FLOOR) if first_chunk else budget
        first_blocks.add(head)
        if left + len(request.tree) <= room or (room > 0 and left == 1):
            plan.batch.append((request, request.tree))
            budget -= left + len(request.tree)
        elif room > 0:
            plan.chunks.append((request, min(room, left - 1)))  # its last token waits for the tree's step
            budget -= min(room, left - 1)
        else:
            continue
        if request.seq is None:
            free_blocks -= need
        first_chunk = False
    if not plan.batch and stuck and now - progress.last_preempt > limits.preempt_every_s:
        youngest = max(stuck, key=lambda r: r.seq.seq_id)
        plan.refused.append((youngest, KVPoolExhausted(
            f"KV pool full: the {len(stuck)} open sessions need more blocks than the pool has; this one (the "
            "youngest) was stopped so that the others can finish; retry later", retry_after_s=RETRY_AFTER_S)))
        plan.preempted = True
    return plan


def tree_sizes(verifies: list[VerifyRequest], budget: int, cost: CostModel) -> list[int]:
    """Draft nodes to verify per session. Trees with acceptance estimates are merged best node first and cut
    where expected tokens per millisecond of the whole step peak (the cost model: pass time by tokens in the
    step); trees without them get an equal share of the token budget. Alone, a session keeps its tree
    within the budget: its client's controller, which knows its round trip, already sized it."""
    share = max(0, (budget - len(verifies)) // max(1, len(verifies)))
    if len(verifies) == 1:
        return [min(len(verifies[0].tree), share)]
    sizes = [0 if r.tree.accept_probs is not None else min(len(r.tree), share) for r in verifies]
    tokens = len(verifies) + sum(sizes)  # in the step before any estimated node
    # Every estimated node, best first; a path probability never exceeds its parent's, so each session's
    # nodes keep their order (and any count of them from the front is a tree).
    nodes = sorted((-p, i, k) for i, r in enumerate(verifies) if r.tree.accept_probs is not None
                   for k, p in enumerate(np.minimum.accumulate(np.asarray(r.tree.accept_probs, dtype=np.float64))))
    nodes = nodes[: max(0, budget - tokens)]
    if not nodes:
        return sizes
    pass_ms = cost.table(tokens - 1 + len(nodes))[tokens - 1 :]
    take = best_tree_size([-p for p, _, _ in nodes], pass_ms, base=len(verifies))
    for _, i, _ in nodes[:take]:
        sizes[i] += 1
    return sizes
