"""VerifyScheduler: one thread owns the engine and runs continuous batches of every session's work.

Requests (open = prefill, verify = one draft tree, close) arrive from any thread as futures. Each engine
step takes every pending verification, with its tree trimmed to the nodes whose expected tokens are worth
the step time they add at the current load, within `max_batch_tokens` (speculation must not make a loaded
server slower than plain decoding), then adds prefills while the budget and the KV pool allow. A prefill
waits a step when another in the same step starts with the same block of tokens, so that it reuses the
first one's cached prefix instead of computing and storing its own. When the pool cannot hold a request
it waits while sessions finish; it fails with KVPoolExhausted only if it could never fit, or if no
session has given blocks back for `admission_timeout_s` (the pool is held, not draining).

Before a step, the scheduler waits for the sessions of the last step to send their next work (their
clients draft between verdict and next tree) for up to DUE_WAIT_FRACTION of a step: a session that
misses a step waits a whole one, so a short wait for it pays whenever it comes. With none due, it
gathers for `gather_ms` so that concurrent newcomers share a step.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from specedge.cloud.engine import Engine, Sequence
from specedge.cloud.kv_pool import KVPoolExhausted
from specedge.common.acceptance import Verdict
from specedge.common.cost_model import CostModel, CostTracker
from specedge.common.draft_tree import DraftTree
from specedge.common.sampling import SamplingParams

RETRY_AFTER_S = 1.0  # told to a client whose request was refused for now, not for good
DUE_WAIT_FRACTION = 0.1  # of the last step's time: the longest wait for last step's sessions to come back


@dataclass
class StepOutcome:
    verdict: Verdict
    tree_sent: int  # draft nodes actually verified (after trimming)
    queue_ms: float
    compute_ms: float
    others: int = 0  # tokens of other sessions in the same step: the load this session shared
    cached_prompt_tokens: int = 0  # for an open: prompt tokens whose KV came from the prefix cache

    def cost_model(self, costs: CostTracker) -> CostModel:
        """The pass time this session would see for each tree size at the load of its last step."""
        model = costs.model()
        return CostModel(tuple((n, model.ms(self.others + n)) for n, _ in model.points))


@dataclass
class _Work:
    kind: str  # "open", "verify", "close"
    future: Future
    seq: Sequence | None = None
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    tree: DraftTree = field(default_factory=DraftTree.empty)
    submitted: float = field(default_factory=time.perf_counter)
    cached: int = 0


@dataclass
class StepStats:
    sessions: int
    prefills: int
    tokens: int
    ms: float


class VerifyScheduler:
    def __init__(self, engine: Engine, max_batch_tokens: int = 2048, gather_ms: float = 2.0,
                 admission_timeout_s: float = 30.0, on_step=None, own_thread: bool = True) -> None:
        """Engine steps run on a thread of the scheduler's own, or (`own_thread=False`) on the thread that
        calls `run()`: best the one that loaded the model. Torch's OpenMP pool belongs to the first
        thread that used it; a second thread running parallel kernels makes libgomp stop spinning and
        every kernel waits for its workers to wake (measured: 55 -> 100 ms per SmolLM2 decode step)."""
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.gather_s = gather_ms / 1e3
        self.admission_timeout_s = admission_timeout_s
        self.costs = CostTracker()
        self.on_step = on_step  # called with StepStats after every engine step (metrics)
        self.active = 0  # open sequences
        self._last_release = 0.0  # when a session last gave its blocks back (perf_counter)
        self._last_preempt = 0.0
        self._inbox: queue.Queue[_Work | None] = queue.Queue()
        self._waiting: deque[_Work] = deque()
        self._due: set[int] = set()  # sequences served by the last step whose next work has not arrived
        self._last_step_s = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="verify-scheduler", daemon=True) if own_thread else None
        if self._thread is not None:
            self._thread.start()

    # ---- any thread --------------------------------------------------------------------------------

    def open(self, prompt_ids: list[int], params: SamplingParams, tree: DraftTree) -> Future:
        """-> Future[(Sequence, StepOutcome)]: the prompt prefilled and `tree` verified with it."""
        return self._submit(_Work("open", Future(), prompt_ids=prompt_ids, params=params, tree=tree))

    def verify(self, seq: Sequence, tree: DraftTree) -> Future:
        """-> Future[StepOutcome]."""
        return self._submit(_Work("verify", Future(), seq=seq, tree=tree))

    def close(self, seq: Sequence) -> Future:
        return self._submit(_Work("close", Future(), seq=seq))

    def budget_per_session(self) -> int:
        """The largest draft a session gets without trimming when every active session sends one."""
        return max(0, self.max_batch_tokens // max(1, self.active) - 1)

    def stop(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def run(self) -> None:
        """Run engine steps on the calling thread until `stop()` (for `own_thread=False`)."""
        self._run()

    def _submit(self, work: _Work) -> Future:
        if self._stopped:
            _fail(work.future, RuntimeError("the verifier is shutting down"))
        else:
            self._inbox.put(work)
        return work.future

    # ---- the scheduler thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            if not self._waiting:
                first = self._inbox.get()
                if first is None:
                    break
                self._accept(first)
            if self._due:
                self._drain_inbox(until=time.perf_counter() + max(self.gather_s, DUE_WAIT_FRACTION * self._last_step_s),
                                  until_none_due=True)
            else:
                self._drain_inbox(until=time.perf_counter() + self.gather_s)  # so newcomers share the step
            self._step()
        for work in self._waiting:  # shutting down
            _fail(work.future, RuntimeError("the verifier is shutting down"))

    def _step(self) -> None:
        for work in [w for w in self._waiting if w.kind != "close" and w.future.cancelled()]:
            self._waiting.remove(work)  # its client gave up before it ran
        for work in [w for w in self._waiting if w.kind == "close"]:
            self._waiting.remove(work)
            for orphan in [w for w in self._waiting if w.kind == "verify" and w.seq is work.seq]:
                self._waiting.remove(orphan)  # its client went away while it waited
                _fail(orphan.future, RuntimeError("the session was closed"))
            self.engine.release(work.seq)
            self._last_release = time.perf_counter()
            self.active -= 1
            if work.future.set_running_or_notify_cancel():
                work.future.set_result(None)
        verifies = [w for w in self._waiting if w.kind == "verify"]
        opens = [w for w in self._waiting if w.kind == "open"]
        pool = self.engine.pool
        budget = self.max_batch_tokens
        batch: list[_Work] = []
        trees: list[DraftTree] = []
        free_blocks = pool.num_available()
        # Verifications first: every session gets its own token, then draft nodes as far as they pay.
        sizes = self._tree_sizes(verifies, budget)
        for w, n in zip(verifies, sizes):
            need = pool.blocks_needed(w.seq.seq_id, len(w.seq.token_ids) + n)
            while n > 0 and need > free_blocks:  # shrink the tree to what the pool can hold
                n //= 2
                need = pool.blocks_needed(w.seq.seq_id, len(w.seq.token_ids) + n)
            if need > free_blocks:
                continue  # not even its own token fits now: it waits for blocks to come back
            free_blocks -= need
            budget -= 1 + n
            batch.append(w)
            trees.append(w.tree.prefix(n))
        # Then prefills, while the budget and the pool allow (always one when nothing else runs).
        first_blocks = set()
        for w in opens:
            head = tuple(w.prompt_ids[: pool.block_size])
            if head in first_blocks and len(w.prompt_ids) > pool.block_size:
                continue  # let it reuse this step's prefill of the same prefix next step
            tokens = len(w.prompt_ids) + len(w.tree)
            if batch and tokens > budget:
                continue
            try:
                seq = self.engine.add_sequence(w.prompt_ids, w.params)
            except ValueError as e:
                self._waiting.remove(w)
                _fail(w.future, e)
                continue
            need = pool.blocks_needed(seq.seq_id, tokens)
            if need > free_blocks:
                self.engine.release(seq)
                cannot_ever = -(-tokens // pool.block_size) > pool.num_blocks
                waited = time.perf_counter() - max(w.submitted, self._last_release) > self.admission_timeout_s
                if cannot_ever or waited:
                    self._waiting.remove(w)
                    _fail(w.future, KVPoolExhausted(
                        f"KV pool full: the prompt needs {need} blocks of {pool.block_size} tokens, "
                        f"{free_blocks} of {pool.num_blocks} free" + ("" if cannot_ever else " after waiting"),
                        retry_after_s=None if cannot_ever else RETRY_AFTER_S))
                continue
            free_blocks -= need
            budget -= tokens
            first_blocks.add(head)
            w.seq = seq
            w.cached = seq.num_cached
            self.active += 1
            batch.append(w)
            trees.append(w.tree)
        if not batch:
            stuck = [w for w in verifies if w in self._waiting]
            if stuck and time.perf_counter() - self._last_preempt > 1.0:
                self._preempt(stuck)
            if self._waiting:
                time.sleep(0.005)  # everything waits for blocks: let closes arrive
                self._drain_inbox()
            return
        start = time.perf_counter()
        verdicts = self.engine.step([(w.seq, t) for w, t in zip(batch, trees)])
        ms = (time.perf_counter() - start) * 1e3
        self._last_step_s = ms / 1e3
        self._due.clear()
        step_tokens = sum((len(t) + 1) if w.kind == "verify" else len(w.prompt_ids) + len(t)
                          for w, t in zip(batch, trees))
        if all(w.kind == "verify" for w in batch):  # pass time by tokens beyond the first, at any load
            self.costs.observe(step_tokens - 1, ms)
        for w, t, v in zip(batch, trees, verdicts):
            self._waiting.remove(w)
            queue_ms = (start - w.submitted) * 1e3
            own = len(t) + (1 if w.kind == "verify" else len(w.prompt_ids))
            outcome = StepOutcome(v, len(t), queue_ms, ms, others=step_tokens - own, cached_prompt_tokens=w.cached)
            if not w.future.set_running_or_notify_cancel():  # nobody waits for it any more
                if w.kind == "open":
                    self.engine.release(w.seq)
                    self._last_release = time.perf_counter()
                    self.active -= 1
                continue
            w.future.set_result((w.seq, outcome) if w.kind == "open" else outcome)
            self._due.add(w.seq.seq_id)
        if self.on_step is not None:
            self.on_step(StepStats(len(batch), sum(w.kind == "open" for w in batch), step_tokens, ms))

    def _preempt(self, stuck: list[_Work]) -> None:
        """Every session waits for blocks that only another session's end could free: a deadlock. The
        youngest session is refused (its stream ends, its blocks come back; its client resumes it a little
        later with the prompt plus what it has committed, as after any break) so that the others finish.
        Called at most once a second, leaving time for its close to arrive."""
        youngest = max(stuck, key=lambda w: w.seq.seq_id)
        self._waiting.remove(youngest)
        self._last_preempt = time.perf_counter()
        _fail(youngest.future, KVPoolExhausted(
            f"KV pool full: the {len(stuck)} open sessions need more blocks than the pool has; this one (the "
            "youngest) was stopped so that the others can finish; retry later", retry_after_s=RETRY_AFTER_S))

    def _tree_sizes(self, verifies: list[_Work], budget: int) -> list[int]:
        """Draft nodes to verify per session. Scored trees (the drafter's acceptance estimates) are merged
        best node first while a node's expected tokens are worth the step time it adds at this load
        (the cost model: pass time by tokens in the step), so a crowded step never gets slower per
        expected token than plain decoding; unscored trees get an equal share of the token budget."""
        share = max(0, (budget - len(verifies)) // max(1, len(verifies)))
        if len(verifies) == 1:  # alone, the client's controller (which knows its round trip) decides
            return [min(len(verifies[0].tree), share)]
        sizes = [0 if w.tree.scores is not None else min(len(w.tree), share) for w in verifies]
        scored = [i for i, w in enumerate(verifies) if w.tree.scores is not None and len(w.tree)]
        if not scored:
            return sizes
        cost = self.costs.model()
        tokens = len(verifies) + sum(sizes)  # in the step so far
        expected = float(len(verifies))  # tokens committed: every session's own, plus accepted drafts
        heap = [(-verifies[i].tree.scores[0], i) for i in scored]
        heapq.heapify(heap)
        limit = budget - len(verifies)
        while heap and tokens - len(verifies) < limit:
            neg_p, i = heapq.heappop(heap)
            if (expected - neg_p) * cost.ms(tokens - 1) < expected * cost.ms(tokens):
                break  # the best node left no longer pays for itself; none after it will either
            expected, tokens, sizes[i] = expected - neg_p, tokens + 1, sizes[i] + 1
            scores = verifies[i].tree.scores
            if sizes[i] < len(scores):
                heapq.heappush(heap, (-scores[sizes[i]], i))
        return sizes

    def _drain_inbox(self, until: float = 0.0, until_none_due: bool = False) -> None:
        """Move arrived work to the waiting list, waiting for more until `until` (perf_counter time), or
        (`until_none_due`) until every session of the last step has sent its next work."""
        while not (until_none_due and not self._due):
            timeout = until - time.perf_counter()
            try:
                item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stopped = True
                return
            self._accept(item)

    def _accept(self, work: _Work) -> None:
        self._waiting.append(work)
        if work.seq is not None:
            self._due.discard(work.seq.seq_id)


def _fail(future: Future, error: BaseException) -> None:
    """Fail a request's future unless its waiter has cancelled it (then nobody needs to know)."""
    if not future.done() and future.set_running_or_notify_cancel():
        future.set_exception(error)
