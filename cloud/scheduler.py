"""VerifyScheduler: the thread that owns the engine and runs continuous batches of every session's work.

Requests (cloud/requests.py) arrive from any thread with a future to resolve. Each step is: apply the
closes that arrived, plan (cloud/step_plan.py: a pure function), run the planned batch in one engine
pass, hand every session its outcome.

Before a step, the scheduler waits for the sessions of the last step to send their next work (their
clients draft between verdict and next tree) for up to DUE_WAIT_FRACTION of a step: a session that
misses a step waits a whole one, so a short wait for it pays whenever it comes; once they are all back
the step starts. After a step that served no session (an idle verifier), it gathers for `gather_ms` so
that concurrent newcomers share a step.

An error escaping a step ends the scheduler, since the engine's state is unknown after it: every request,
waiting or yet to come, fails with SchedulerFailed (the server answers UNAVAILABLE and reports NOT_SERVING,
so clients resume elsewhere) rather than waiting for a thread that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

from specedge.cloud.acceptance import Verdict
from specedge.cloud.cost_tracker import CostTracker
from specedge.cloud.engine import Engine, Sequence
from specedge.cloud.requests import (CloseRequest, FlushCacheRequest, OpenRequest, Request, StepOutcome, StepRequest,
                                     VerifyRequest)
from specedge.cloud.step_plan import PoolProgress, StepLimits, StepPlan, plan_step
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams

log = logging.getLogger("specedge.server")

DUE_WAIT_FRACTION = 0.1  # of the last step's time: the longest wait for last step's sessions to come back


class SchedulerFailed(RuntimeError):
    """The scheduler stopped on an error of its own: no request will be served here any more."""


@dataclass
class _Scheduled:
    """A request in this step's batch, with its sequence (opened now, for a prefill) and its trimmed tree."""

    request: StepRequest
    seq: Sequence
    tree: DraftTree
    tokens: int  # what it feeds the pass
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class StepStats:
    sessions: int
    prefills: int
    tokens: int
    ms: float


class VerifyScheduler:
    def __init__(self, engine: Engine, limits: StepLimits = StepLimits(), gather_ms: float = 2.0,
                 on_step: Callable[[StepStats], None] | None = None, own_thread: bool = True,
                 on_failure: Callable[[BaseException], None] | None = None,
                 answering: Callable[[], AbstractContextManager] = nullcontext) -> None:
        """Engine steps run on a thread of the scheduler's own, or (`own_thread=False`) on the thread that
        calls `run()`: best the one that loaded the model. Torch's OpenMP pool belongs to the first
        thread that used it; a second thread running parallel kernels makes libgomp stop spinning and
        every kernel waits for its workers to wake (measured: 55 -> 100 ms per SmolLM2 decode step).
        `on_failure` is called, on the scheduler's thread, with the error that ended it. A step's answers
        are given inside `answering()`, for a waiter that hands them on together (cloud/loop_futures.py)."""
        self.engine = engine
        self.limits = limits
        self.gather_s = gather_ms / 1e3
        self.costs = CostTracker.for_device(engine.device)
        self.on_step = on_step
        self.on_failure = on_failure
        self.answering = answering
        self.failure: BaseException | None = None  # what ended the scheduler, if an error did
        self.active_sessions = 0  # open sequences
        self._progress = PoolProgress()
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._waiting: list[StepRequest] = []
        self._closing: list[CloseRequest] = []
        self._due: set[int] = set()  # sequences served by the last step whose next work has not arrived
        self._stepping: list[_Scheduled] = []  # the batch of the step under way
        self._last_step_s = 0.0
        self._stopped = False
        self._refusal: RuntimeError | None = None  # once set, every request fails with it at once
        self._submit_lock = threading.Lock()  # no request slips into the inbox after its last drain
        self._thread = threading.Thread(target=self.run, name="verify-scheduler", daemon=True) if own_thread else None
        if self._thread is not None:
            self._thread.start()

    # ---- any thread --------------------------------------------------------------------------------

    def open(self, prompt_ids: list[int], params: SamplingParams, tree: DraftTree, hints_top_k: int = 0,
             on_progress: Callable[[int, int], None] | None = None, prompt_hints: bool = False
             ) -> Future[tuple[Sequence, StepOutcome]]:
        """The prompt prefilled and `tree` verified with it; `hints_top_k` > 0: every verdict has hints, the
        first also at the prompt's positions with `prompt_hints`.
        `on_progress(prompt tokens with KV, prompt length)` is called, on the scheduler's thread, after each
        chunk of a prefill too long for one step."""
        return self._submit(OpenRequest(prompt_ids, params, tree, hints_top_k=hints_top_k, on_progress=on_progress,
                                        prompt_hints=prompt_hints))

    def verify(self, seq: Sequence, tree: DraftTree) -> Future[StepOutcome]:
        return self._submit(VerifyRequest(seq, tree))

    def close(self, seq: Sequence) -> Future[None]:
        return self._submit(CloseRequest(seq))

    def flush_cache(self) -> Future[int]:
        """The cached prefixes no sequence uses forgotten (the pool is the scheduler thread's); -> blocks."""
        return self._submit(FlushCacheRequest())

    @property
    def waiting_requests(self) -> int:
        """Requests not yet in a step (read from any thread: a moment's snapshot)."""
        return len(self._waiting) + self._inbox.qsize()

    def cost_model(self) -> CostModel:
        """Pass time by draft tokens, as measured so far."""
        return self.costs.model()

    def stop(self) -> None:
        self._refuse(RuntimeError("the verifier is shutting down"))
        self._stopped = True
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _submit(self, request: Request) -> Future:
        with self._submit_lock:
            if self._refusal is None:
                self._inbox.put(request)
                return request.future
        _fail(request.future, self._refusal)
        return request.future

    def _refuse(self, error: RuntimeError) -> None:
        with self._submit_lock:
            self._refusal = self._refusal or error

    # ---- the scheduler thread ----------------------------------------------------------------------

    def run(self) -> None:
        """Run engine steps until `stop()` or an error (on the calling thread, for `own_thread=False`)."""
        try:
            while not self._stopped:
                returning = bool(self._due)  # the last step served sessions, which will send their next work
                if not self._waiting and not self._closing:
                    first = self._inbox.get()
                    if first is None:
                        break
                    self._accept(first)
                if self._due:
                    wait = max(self.gather_s, DUE_WAIT_FRACTION * self._last_step_s)
                    self._drain_inbox(until=time.perf_counter() + wait, until_none_due=True)
                elif not returning:
                    self._drain_inbox(until=time.perf_counter() + self.gather_s)  # so newcomers share the step
                else:  # all of them are back: step now (a lone session would pay the gathering every round)
                    self._drain_inbox()
                self.step()
        except Exception as e:
            log.error("the verify scheduler failed", exc_info=e)
            self.failure = e
            summary = f"{type(e).__name__}: {e}"[:200]
            self._refuse(SchedulerFailed(f"the verifier failed ({summary}): reopen the session elsewhere"))
            if self.on_failure is not None:
                try:
                    self.on_failure(e)
                except Exception:  # the requests below must be failed whatever the listener does
                    log.exception("the scheduler's failure listener failed")
        self._refuse(RuntimeError("the verifier is shutting down"))
        self._fail_everything_left()

    def _fail_everything_left(self) -> None:
        """Once no request can enter: fail what waits, what the last step held and what sits in the inbox."""
        left = [*self._waiting, *(item.request for item in self._stepping), *self._closing]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item)
        self._waiting, self._stepping, self._closing = [], [], []
        for request in left:
            if isinstance(request, CloseRequest):  # nothing to release any more
                if request.future.set_running_or_notify_cancel():
                    request.future.set_result(None)
            else:
                _fail(request.future, self._refusal)

    def step(self) -> None:
        """One engine step: apply the closes that arrived, plan, run the plan's batch, hand out outcomes."""
        self._apply_closes()
        now = time.perf_counter()
        plan = plan_step(self._waiting, self.engine.pool, self.costs.model(), self.limits, now, self._progress)
        for request, error in plan.refused:
            self._waiting.remove(request)
            _fail(request.future, error)
        if plan.preempted:
            self._progress = replace(self._progress, last_preempt=now)
        batch = self._stepping = self._start(plan)
        chunks = self._start_chunks(plan)
        if batch or chunks:
            start = time.perf_counter()
            verdicts = self.engine.step([(item.seq, item.tree) for item in batch],
                                        [(request.seq, n) for request, n in chunks])
            self._finish(batch, verdicts, chunks, start, time.perf_counter())
        elif self._waiting:
            time.sleep(0.005)  # everything waits for blocks: let closes arrive
            self._drain_inbox()
        self._stepping = []

    def _apply_closes(self) -> None:
        for gone in [r for r in self._waiting if r.future.cancelled()]:  # their clients gave up
            self._waiting.remove(gone)
            if isinstance(gone, OpenRequest) and gone.seq is not None:  # in the middle of a chunked prefill
                self._release(gone.seq)
        for close in self._closing:
            for orphan in [r for r in self._waiting if isinstance(r, VerifyRequest) and r.seq is close.seq]:
                self._waiting.remove(orphan)  # its client went away while it waited
                _fail(orphan.future, RuntimeError("the session was closed"))
            self._release(close.seq)
            if close.future.set_running_or_notify_cancel():
                close.future.set_result(None)
        self._closing.clear()

    def _start(self, plan: StepPlan) -> list[_Scheduled]:
        """Take the plan's requests off the waiting list; open the sequences of its prefills."""
        batch = []
        for request, tree in plan.batch:
            self._waiting.remove(request)
            if isinstance(request, VerifyRequest):
                batch.append(_Scheduled(request, request.seq, tree, tokens=1 + len(tree)))
                continue
            seq = request.seq or self._open(request)
            if seq is None:
                continue
            uncomputed = len(seq.token_ids) - seq.num_cached
            batch.append(_Scheduled(request, seq, tree, uncomputed + len(tree), request.cached_prompt_tokens))
        return batch

    def _start_chunks(self, plan: StepPlan) -> list[tuple[OpenRequest, int]]:
        """The plan's prefill chunks, their sequences opened at the first with every block they will need
        (so that no later chunk waits for blocks); they stay waiting for their next chunk."""
        chunks = []
        for request, n in plan.chunks:
            if request.seq is None:
                if self._open(request) is None:
                    self._waiting.remove(request)
                    continue
                self.engine.pool.reserve(request.seq.seq_id, len(request.prompt_ids) + len(request.tree))
            chunks.append((request, n))
        return chunks

    def _open(self, request: OpenRequest) -> Sequence | None:
        try:
            seq = self.engine.add_sequence(request.prompt_ids, request.params, request.hints_top_k,
                                           request.prompt_hints)
        except ValueError as e:
            _fail(request.future, e)
            return None
        self.active_sessions += 1
        request.seq, request.cached_prompt_tokens = seq, seq.num_cached
        return seq

    def _finish(self, batch: list[_Scheduled], verdicts: list[Verdict], chunks: list[tuple[OpenRequest, int]],
                start: float, end: float) -> None:
        """Learn the pass's cost, resolve every request with its outcome, tell chunked prefills' progress."""
        ms = (end - start) * 1e3
        self._last_step_s = ms / 1e3
        step_tokens = sum(item.tokens for item in batch) + sum(n for _, n in chunks)
        prefills = sum(isinstance(item.request, OpenRequest) for item in batch) + len(chunks)
        if not prefills:  # pass time by tokens beyond the first, at any load
            self.costs.observe(step_tokens - 1, ms)
        for request, _ in chunks:
            _tell_progress(request)
        cost = self.costs.model()
        next_max = max(0, self.limits.max_batch_tokens // max(1, self.active_sessions) - 1)
        self._due.clear()
        with self.answering():
            for item, verdict in zip(batch, verdicts):
                request = item.request
                outcome = StepOutcome(verdict, len(item.tree), (start - request.submitted) * 1e3, ms,
                                      cost.at_load(step_tokens - item.tokens), self.active_sessions, next_max,
                                      item.cached_prompt_tokens)
                if not request.future.set_running_or_notify_cancel():  # nobody waits for it any more
                    if isinstance(request, OpenRequest):
                        self._release(item.seq)
                    continue
                request.future.set_result((item.seq, outcome) if isinstance(request, OpenRequest) else outcome)
                self._due.add(item.seq.seq_id)
        if self.on_step is not None:
            self.on_step(StepStats(len(batch), prefills, step_tokens, ms))

    def _release(self, seq: Sequence) -> None:
        self.engine.release(seq)
        self.active_sessions -= 1
        self._progress = replace(self._progress, last_release=time.perf_counter())

    def _drain_inbox(self, until: float = 0.0, until_none_due: bool = False) -> None:
        """Move arrived requests in, waiting for more until `until` (perf_counter time), or (`until_none_due`)
        until every session of the last step has sent its next work."""
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

    def _accept(self, request: Request) -> None:
        if isinstance(request, FlushCacheRequest):
            if request.future.set_running_or_notify_cancel():
                request.future.set_result(self.engine.pool.drop_cached())
            return
        if isinstance(request, CloseRequest):
            self._closing.append(request)
        else:
            self._waiting.append(request)
        if not isinstance(request, OpenRequest):
            self._due.discard(request.seq.seq_id)


def _tell_progress(request: OpenRequest) -> None:
    if request.on_progress is not None:
        try:
            request.on_progress(request.seq.num_cached, len(request.prompt_ids))
        except Exception:  # a listener's trouble is not the scheduler's
            log.warning("a prefill progress listener failed", exc_info=True)


def _fail(future: Future, error: BaseException) -> None:
    """Fail a request's future unless its waiter has cancelled it (then nobody needs to know)."""
    if not future.done() and (future.running() or future.set_running_or_notify_cancel()):
        future.set_exception(error)
