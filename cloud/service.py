"""The Verifier service's handlers (protos/specedge/v1/verifier.proto), on grpc's asyncio server.

Handlers parse and validate what clients send themselves (raw bytes in, so that even undecodable bytes
get INVALID_ARGUMENT), hand engine work to the VerifyScheduler and await it. A session's blocks are
released however its stream ends: close, error, client cancel or disconnect, idle timeout, deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace

import grpc
from google.protobuf.message import DecodeError

from specedge import __version__
from specedge.cloud.cache_watchers import CacheWatchers, net_changes
from specedge.cloud.client_limits import ClientLimits, LimitExceeded
from specedge.cloud.config import ServerConfig
from specedge.cloud.engine import Engine
from specedge.cloud.identity import Identities, read_token_file
from specedge.cloud.kv_pool import KVPoolExhausted
from specedge.cloud.loop_futures import LoopFutures
from specedge.cloud.metrics import VerifierMetrics
from specedge.cloud.requests import StepOutcome
from specedge.cloud.scheduler import VerifyScheduler
from specedge.cloud.step_plan import StepLimits
from specedge.cloud.verifier_drafter import VerifierDrafter, WarmDrafters, client_share
from specedge.common import wire
from specedge.common.draft_tree import DraftTree
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.protos import verifier_pb2 as pb

log = logging.getLogger("specedge.server")

LOAD_REPORT_S = 0.25  # WatchCache sends the load at least this often


@dataclass
class ServedModel:
    """What a verifier serves: the engine, the ids it stops on, and its tokenizer."""

    engine: Engine
    eos_ids: list[int]
    fingerprint: str  # of the tokenizer, which edges compare before they trust token ids
    tokenizer: TokenizerBundle | None = None  # None: a test model served by token ids only


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class VerifierService:
    def __init__(self, model: ServedModel, config: ServerConfig, scheduler_thread: bool = True) -> None:
        self.model, self.engine, self.config = model, model.engine, config
        self.metrics = VerifierMetrics(model.engine.pool)
        self.cache_watchers = CacheWatchers(model.engine.pool)  # before the scheduler changes the pool
        limits = StepLimits(config.max_batch_tokens, config.admission_timeout_s)
        self._loop = asyncio.get_running_loop()  # the server's: this service's state changes only on it
        self._answers = LoopFutures(self._loop)  # the scheduler's answers, a step's in one wake-up
        self.scheduler = VerifyScheduler(model.engine, limits, config.gather_ms, on_step=self.metrics.on_step,
                                         own_thread=scheduler_thread, on_failure=self._scheduler_failed,
                                         answering=self._answers.answering)
        tokens = read_token_file(config.auth_tokens) if config.auth_tokens else {}
        relays = frozenset(r.strip() for r in config.trusted_relays.split(",") if r.strip())
        self.identities = Identities(tokens, relays)  # whom the per-client limits count against
        self.warm_drafters = WarmDrafters(config.warm_drafter_clients)  # per client, for the sessions it fills
        self.limits = ClientLimits(config.max_sessions_per_client, config.max_tokens_per_client)
        self.draining = False  # no new sessions
        self.migrating = False  # live sessions leave now (a round in flight is dropped)
        self._interruptible_work: set[asyncio.Future] = set()  # what sessions await, cancelled when they move
        self.on_drain: list = []  # called when draining starts (the server reports NOT_SERVING)

    # ---- RPCs -------------------------------------------------------------------------------------

    async def GetInfo(self, raw: bytes, context) -> bytes:
        try:
            _parse(pb.GetInfoRequest, raw)
        except _Abort as e:
            self.metrics.errors.labels(e.code.name).inc()
            await context.abort(e.code, e.message, e.trailing)
        return self.info().SerializeToString()

    def info(self) -> pb.VerifierInfo:
        c = self.config
        return pb.VerifierInfo(
            model=c.model, tokenizer_fingerprint=self.model.fingerprint, vocab_size=self.engine.vocab_size,
            eos_token_ids=self.model.eos_ids, server_version=__version__,
            limits=pb.Limits(max_prompt_tokens=c.max_prompt_tokens, max_tree_tokens=c.max_tree_tokens,
                             max_new_tokens=c.max_new_tokens, max_sessions_per_client=c.max_sessions_per_client,
                             max_tokens_per_client=c.max_tokens_per_client,
                             max_batch_tokens=c.max_batch_tokens, max_hints_top_k=c.max_hints_top_k),
            cost=wire.cost_to_pb(self.scheduler.cost_model(), self.scheduler.active_sessions))

    async def GetTokenizer(self, raw: bytes, context):
        try:
            req = _parse(pb.GetTokenizerRequest, raw)
            if self.model.tokenizer is None:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             "this verifier serves token ids only: it has no tokenizer to give")
            if req.fingerprint and req.fingerprint != self.model.fingerprint:
                raise _Abort(grpc.StatusCode.NOT_FOUND, f"this verifier's tokenizer is {self.model.fingerprint}, "
                             f"not {wire.shown(req.fingerprint)}")
            for part in wire.tokenizer_to_parts(self.model.tokenizer, self.model.fingerprint):
                yield part.SerializeToString()
        except _Abort as e:
            self.metrics.errors.labels(e.code.name).inc()
            await context.abort(e.code, e.message, e.trailing)

    async def Session(self, requests, context):
        seq, client, claim, started = None, None, 0, time.perf_counter()
        label = identity = None  # for the log: what the client calls itself, and who it is
        drafter: VerifierDrafter | None = None  # from the first round that asks the verifier to draft
        try:
            first = await self._next(requests, context)
            if first is None:
                return
            if first.WhichOneof("kind") != "open":
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be `open`")
            op = first.open
            prompt, params, tree = self._validate_open(op.prompt_ids, op.params, op.draft, op.tokenizer_fingerprint)
            label = self._label(op.client_id)
            client, claim = self._admit(self.identities.of(context), len(prompt) + params.max_new_tokens)
            identity = client
            hints_top_k = min(max(0, op.hints_top_k), self.config.max_hints_top_k)  # a larger ask gets the cap
            reports = _PrefillReports(self._loop) if op.report_prefill_progress else None
            opening = self.scheduler.open(prompt, params, tree, hints_top_k, reports and reports.put,
                                          prompt_hints=op.prompt_hints)
            if reports is not None:
                try:
                    async for computed, total in reports.until_done(opening):
                        if self.migrating:
                            break
                        yield pb.SessionResponse(prefill_progress=pb.PrefillProgress(
                            computed=computed, total=total)).SerializeToString()
                except BaseException:  # the client went away mid-prefill
                    self._drop(opening)
                    raise
            seq, outcome = await self._unless_moved(opening)
            generated = list(outcome.verdict.tokens)  # committed after the prompt
            # An end of sequence committed: trees sent ahead of its verdict get empty verdicts (a deep pipeline
            # has many in flight when it comes); a tree sent after that verdict is verified (a client may go on).
            ended = any(t in self.model.eos_ids for t in generated)
            self.metrics.sessions_total.labels("Session").inc()
            session_id = uuid.uuid4().hex[:12]
            cached = outcome.cached_prompt_tokens
            self.metrics.prompt_tokens.labels("cached").inc(cached)
            self.metrics.prompt_tokens.labels("computed").inc(len(prompt) - cached)
            prompt_hints = outcome.verdict.prompt_hints
            yield pb.SessionResponse(opened=pb.Opened(
                session_id=session_id, cached_prompt_tokens=cached, verdict=self._verdict(outcome),
                prompt_hints=wire.hints_to_pb(prompt_hints) if prompt_hints else None,
                prompt_hints_start=outcome.verdict.prompt_hints_start)).SerializeToString()
            while True:
                req = await self._next(requests, context)
                if req is None:  # the client ended its stream without a close: the same, as far as it goes
                    return
                kind = req.WhichOneof("kind")
                if kind == "close":
                    self._release(seq, client, claim)
                    seq = client = None
                    if await self._next(requests, context) is not None:
                        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a message after close: the session has ended")
                    return
                if kind != "draft":
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"expected a draft or close, got {kind or 'an empty message'}")
                behind = 0 < req.draft.root_length < len(prompt) + len(generated)  # sent before verdicts it missed
                if behind and (ended or len(generated) >= params.max_new_tokens):
                    # Sent ahead of the verdicts that ended the generation: nothing to verify, an empty verdict.
                    yield pb.SessionResponse(verdict=pb.Verdict()).SerializeToString()
                    continue
                if len(generated) >= params.max_new_tokens:
                    raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"the session has produced its max_new_tokens ({params.max_new_tokens})")
                tree = _still_to_verify(self._tree(req.draft), req.draft.root_length, len(prompt), generated)
                client_nodes = list(range(len(tree)))
                if req.draft.fill_tokens > 0:  # a tree ahead: the verifier adds its own draft
                    if drafter is None:  # (warm per identity and the name the client gives itself)
                        drafter = VerifierDrafter(prompt, params, hints_top_k, generated, self.warm_drafters,
                                                  f"{identity}|{label or ''}")
                    # One token of the budget is left over, so that the tree after it has a token to verify.
                    filled = drafter.draft(min(req.draft.fill_tokens, self.config.max_tree_tokens), outcome.cost,
                                           tree, max_depth=params.max_new_tokens - len(generated) - 2)
                    tree, client_nodes = filled.tree, filled.client_nodes
                outcome = await self._unless_moved(self.scheduler.verify(seq, tree))
                generated += outcome.verdict.tokens
                ended = ended or any(t in self.model.eos_ids for t in outcome.verdict.tokens)
                if drafter is not None:
                    drafter.observe(tree, outcome.verdict)
                outcome, drafted = _as_sent(outcome, client_nodes)
                yield pb.SessionResponse(verdict=self._verdict(outcome, drafted)).SerializeToString()
        except _Abort as e:
            self.metrics.errors.labels(e.code.name).inc()
            await context.abort(e.code, e.message, e.trailing)
        finally:
            self._release(seq, client, claim)
            if drafter is not None:
                drafter.end()
            log_event("session_end", client=label, identity=identity, seconds=round(time.perf_counter() - started, 3))

    async def Generate(self, raw: bytes, context):
        seq, client, claim = None, None, 0
        try:
            req = _parse(pb.GenerateRequest, raw)
            prompt, params, _ = self._validate_open(req.prompt_ids, req.params, pb.DraftTree(), "")
            self._label(req.client_id)
            client, claim = self._admit(self.identities.of(context), len(prompt) + params.max_new_tokens)
            self.metrics.sessions_total.labels("Generate").inc()
            # A drain moves the stream as it moves sessions: it ends between steps with UNAVAILABLE and
            # `specedge-migrate`, and the client asks again elsewhere with the prompt plus what it has had
            # (edge/resume.py, ResumableGenerate).
            seq, outcome = await self._unless_moved(self.scheduler.open(prompt, params, DraftTree.empty()))
            produced = 0
            while True:
                tokens = outcome.verdict.tokens[: params.max_new_tokens - produced]
                produced += len(tokens)
                done = produced >= params.max_new_tokens or any(t in self.model.eos_ids for t in tokens)
                yield pb.GenerateResponse(tokens=tokens, done=done).SerializeToString()
                if done:
                    return
                outcome = await self._unless_moved(self.scheduler.verify(seq, DraftTree.empty()))
        except _Abort as e:
            self.metrics.errors.labels(e.code.name).inc()
            await context.abort(e.code, e.message, e.trailing)
        finally:
            self._release(seq, client, claim)

    async def WatchCache(self, raw: bytes, context):
        try:
            _parse(pb.WatchCacheRequest, raw)
        except _Abort as e:
            await context.abort(e.code, e.message)
        held, updates = self.cache_watchers.subscribe()
        block_size = self.engine.pool.block_size
        try:
            if not updates.empty():  # closed already: the verifier is stopping
                return
            yield pb.CacheUpdate(snapshot=True, block_size=block_size, stored=held,
                                 load=self.load()).SerializeToString()
            while True:
                try:
                    changes = [await asyncio.wait_for(updates.get(), LOAD_REPORT_S)]
                except asyncio.TimeoutError:
                    changes = []
                while not updates.empty():
                    changes.append(updates.get_nowait())
                if None in changes:  # the watchers were closed
                    return
                stored, removed = net_changes(changes)
                yield pb.CacheUpdate(block_size=block_size, stored=stored, removed=removed,
                                     load=self.load()).SerializeToString()
        finally:
            self.cache_watchers.unsubscribe(updates)

    def load(self) -> pb.Load:
        pool = self.engine.pool
        return pb.Load(active_sessions=self.scheduler.active_sessions, waiting=self.scheduler.waiting_requests,
                       kv_used=pool.stats().used / pool.num_blocks, draining=self.draining)

    async def Drain(self, raw: bytes, context) -> bytes:
        try:
            _parse(pb.DrainRequest, raw)
        except _Abort as e:
            await context.abort(e.code, e.message)
        return pb.DrainReply(sessions=self.drain()).SerializeToString()

    async def FlushCache(self, raw: bytes, context) -> bytes:
        try:
            _parse(pb.FlushCacheRequest, raw)
            blocks = await self._await(self.scheduler.flush_cache())
        except _Abort as e:
            await context.abort(e.code, e.message)
        log_event("flush_cache", blocks=blocks)
        return pb.FlushCacheReply(blocks=blocks).SerializeToString()

    def drain(self) -> int:
        """Take no new sessions and move the live ones away (on this event loop); how many there are."""
        if not self.draining:
            self.draining = True
            for hook in self.on_drain:
                hook()
        self.migrating = True
        for work in list(self._interruptible_work):
            work.cancel()
        live = self.limits.open_sessions
        log_event("drain", sessions=live)
        return live

    def _scheduler_failed(self, error: BaseException) -> None:
        """On the scheduler's thread as it ends: its requests fail with UNAVAILABLE; take no new sessions."""

        def stop_serving() -> None:
            log_event("scheduler_failed", error=f"{type(error).__name__}: {error}"[:200])
            if not self.draining:
                self.draining = True
                for hook in self.on_drain:
                    hook()

        self._loop.call_soon_threadsafe(stop_serving)

    # ---- helpers ----------------------------------------------------------------------------------

    async def _next(self, requests, context) -> pb.SessionRequest | None:
        """The client's next message; a migration ends the wait (the client reopens elsewhere)."""
        read = asyncio.ensure_future(requests.__anext__())
        read.add_done_callback(_retrieved)  # also when the stream ends while nobody waits for it any more
        try:
            raw = await self._interruptible(read, self.config.idle_timeout_s)
        except TimeoutError:
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"session idle for {self.config.idle_timeout_s:.0f} s; its KV blocks were released")
        except StopAsyncIteration:
            return None
        return _parse(pb.SessionRequest, raw)

    async def _interruptible(self, work: asyncio.Future, timeout: float | None = None):
        """`work`'s result, unless a drain starts first (-> _moved()) or `timeout` passes (-> TimeoutError);
        both cancel `work`. Cancelling the awaited future itself, not racing it against another, keeps a
        served round at one wake-up of this loop for each answer it waits for."""
        if self.migrating:
            work.cancel()
            raise _moved()
        self._interruptible_work.add(work)
        timer = None if timeout is None else self._loop.call_later(timeout, work.cancel)
        try:
            return await work
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the handler itself is cancelled: the client went away
                raise
            if self.migrating:
                raise _moved() from None
            raise TimeoutError from None
        finally:
            self._interruptible_work.discard(work)
            if timer is not None:
                timer.cancel()

    def _validate_open(self, prompt_ids, params_msg, draft_msg, fingerprint: str):
        if self.draining:
            raise _moved()
        if fingerprint and fingerprint != self.model.fingerprint:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"tokenizer fingerprint {wire.shown(fingerprint)} differs from the verifier's "
                         f"{self.model.fingerprint}: the edge encodes text differently from this model")
        c, v = self.config, self.engine.vocab_size
        try:
            prompt = wire.prompt_from_pb(prompt_ids, v, c.max_prompt_tokens)
            params = wire.params_from_pb(params_msg, c.max_new_tokens)
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return prompt, params, self._tree(draft_msg)

    def _tree(self, msg: pb.DraftTree) -> DraftTree:
        try:
            return wire.tree_from_pb(msg, self.engine.vocab_size, self.config.max_tree_tokens)
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad draft tree: {e}")

    @staticmethod
    def _label(client_id: str) -> str | None:
        try:
            return wire.client_label(client_id)
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    @property
    def sessions_by_client(self) -> Counter[str]:
        """Each client identity's open sessions here."""
        return self.limits.sessions

    def _admit(self, client: str, tokens: int) -> tuple[str, int]:
        """Count a new session (which may come to hold `tokens` tokens of KV) against its client's limits."""
        try:
            self.limits.admit(client, tokens)
        except LimitExceeded as e:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.metrics.sessions.inc()
        return client, tokens

    def _release(self, seq, client: str | None, tokens: int) -> None:
        if seq is not None:
            self.scheduler.close(seq)  # the scheduler frees the blocks; nothing to wait for
        if client is not None:
            self.limits.release(client, tokens)
            self.metrics.sessions.dec()

    async def _unless_moved(self, future):
        """The scheduler's answer, unless a drain moves the session first: then its work is dropped (nothing
        it would commit has reached the client, which replays from what it has) and the stream ends."""
        try:
            return await self._interruptible(self._answers.wrap(future))
        except (_Abort, asyncio.CancelledError):  # moved, or the client went away: drop the work
            self._drop(future)
            raise
        except Exception as e:
            raise _scheduler_error(e)

    def _drop(self, future) -> None:
        """Nobody will read the scheduler's answer: cancel it, or, answered (or being answered) just now,
        close the session it opened."""
        if not future.cancel():
            future.add_done_callback(self._close_unseen)

    def _close_unseen(self, future) -> None:
        """Close the sequence of an open whose answer its handler no longer waits for."""
        if not future.cancelled() and future.exception() is None and isinstance(future.result(), tuple):
            self.scheduler.close(future.result()[0])

    async def _await(self, future):
        try:
            return await self._answers.wrap(future)
        except Exception as e:
            raise _scheduler_error(e)

    def _verdict(self, o: StepOutcome, verifier_drafted: int = 0) -> pb.Verdict:
        self.metrics.accepted.observe(len(o.verdict.tokens))
        return pb.Verdict(tokens=o.verdict.tokens, accepted=o.verdict.accepted, queue_ms=o.queue_ms,
                          compute_ms=o.compute_ms,
                          next_max_tree_tokens=min(self.config.max_tree_tokens, o.next_max_tree_tokens),
                          cost=wire.cost_to_pb(o.cost, o.active_sessions),
                          hints=wire.hints_to_pb(o.verdict.hints) if o.verdict.hints is not None else None,
                          verifier_drafted=verifier_drafted, verified_nodes=o.tree_sent)


class _PrefillReports:
    """A chunked prefill's progress, reported on the scheduler's thread, as this event loop's async stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._queue = loop, asyncio.Queue()

    def put(self, computed: int, total: int) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (computed, total))

    async def until_done(self, opening):
        """(computed, total) per chunk until the scheduler answers `opening`."""
        opening.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._queue.put_nowait, None))
        while (report := await self._queue.get()) is not None:
            yield report


def _scheduler_error(e: Exception) -> Exception:
    """A scheduler's failure as the status the client gets (anything else as it is)."""
    if isinstance(e, KVPoolExhausted):  # when it may succeed later, say when (the client resumes then)
        retry = () if e.retry_after_s is None else ((wire.RETRY_AFTER_MS, str(round(e.retry_after_s * 1e3))),)
        return _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry)
    if isinstance(e, ValueError):
        return _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, RuntimeError):
        return _Abort(grpc.StatusCode.UNAVAILABLE, str(e))
    return e


def _moved() -> _Abort:
    return _Abort(grpc.StatusCode.UNAVAILABLE, "the verifier is draining: reopen the session elsewhere",
                  ((wire.MIGRATE, "1"),))


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _as_sent(o: StepOutcome, client_nodes: list[int]) -> tuple[StepOutcome, int]:
    """The outcome as the client reads it, where the verifier added its own draft to the client's nodes left
    (`client_nodes`: each one's index in the tree verified), and how many of the committed tokens it drafted
    (`client_share`)."""
    accepted, hints, drafted = client_share(o.verdict.accepted, o.verdict.hints, client_nodes)
    return replace(o, verdict=replace(o.verdict, accepted=accepted, hints=hints)), drafted


def _still_to_verify(tree: DraftTree, root_length: int, prompt_length: int, generated: list[int]) -> DraftTree:
    """A tree sent ahead of verdicts (root_length > 0) less what they committed since its root."""
    if not root_length:
        return tree
    end = prompt_length + len(generated)
    if not prompt_length <= root_length <= end:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad draft tree: root_length {root_length} is not in this "
                     f"session's committed sequence [{prompt_length}, {end}]")
    return tree.after(generated[root_length - prompt_length :])


def _parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {cls.__name__}: {e}")


def log_event(event: str, **fields) -> None:
    log.info(json.dumps({"event": event, **fields}))
