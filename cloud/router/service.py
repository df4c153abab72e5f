"""The router's gRPC services: the Verifier service, relayed (each Session or Generate stream is placed on
one verifier and its messages passed through as bytes), and the Router service (verifiers joining,
operators draining and listing).

A relay that fails before the verifier answered (the verifier is down) is placed again on another one, so
a client is never sent twice to a dead verifier. A stream that breaks later ends with the verifier's
status; if the verifier went away, with `specedge-migrate` added, so that the client reopens at once
through the router (which places it elsewhere) with the prompt plus its committed tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from specedge.cloud.client_limits import ClientLimits, LimitExceeded
from specedge.cloud.identity import CLIENT_IDENTITY, Identities
from specedge.cloud.router.fleet import Fleet, Member
from specedge.cloud.router.metrics import RouterMetrics
from specedge.cloud.router.placement import NoVerifier, place
from specedge.common import wire
from specedge.protos import router_pb2 as rpb
from specedge.protos import verifier_pb2 as pb

log = logging.getLogger("specedge.router")

VERIFIER_METHOD = "/specedge.v1.Verifier/"
MAX_PLACEMENTS = 3  # verifiers tried for one session before the client is told none is serving


class RouterService:
    def __init__(self, fleet: Fleet, metrics: RouterMetrics, identities: Identities | None = None) -> None:
        self.fleet, self.metrics = fleet, metrics
        self.identities = identities or Identities()
        c = fleet.config
        self.limits = ClientLimits(c.max_sessions_per_client, c.max_tokens_per_client)  # over all its verifiers

    @contextlib.asynccontextmanager
    async def _admitted(self, context, prompt: list[int], params: pb.SamplingParams):
        """The relay of a session or Generate stream, counted against its client's limits while it lasts
        (RESOURCE_EXHAUSTED when they do not allow it)."""
        client = self.identities.of(context)
        claim = len(prompt) + (params.max_new_tokens or wire.DEFAULT_MAX_NEW_TOKENS)
        try:
            self.limits.admit(client, claim)
        except LimitExceeded as e:
            self.metrics.refused.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            yield
        finally:
            self.limits.release(client, claim)

    def _upstream_metadata(self, context) -> tuple:
        """The router's own credentials, and the client's identity for verifiers that trust the router."""
        return self.fleet.metadata + ((CLIENT_IDENTITY, self.identities.of(context)),)

    # ---- the Verifier service, relayed -------------------------------------------------------------

    async def GetInfo(self, raw: bytes, context) -> bytes:
        member = await self._any(context)
        try:
            return await member.channel.unary_unary(VERIFIER_METHOD + "GetInfo")(
                raw, metadata=self.fleet.metadata, timeout=30)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details())

    async def GetTokenizer(self, raw: bytes, context):
        member = await self._any(context)
        try:
            async for part in member.channel.unary_stream(VERIFIER_METHOD + "GetTokenizer")(
                    raw, metadata=self.fleet.metadata):
                yield part
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details())

    async def Session(self, requests, context):
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        opening = _parse(pb.SessionRequest, first)
        if opening is None or opening.WhichOneof("kind") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be `open`")
        prompt = list(opening.open.prompt_ids)
        metadata = self._upstream_metadata(context)
        session = lambda m: m.channel.stream_stream(VERIFIER_METHOD + "Session")(metadata=metadata)  # noqa: E731
        async with self._admitted(context, prompt, opening.open.params):
            call, member, reply = await self._open(context, prompt, session, first)
            pump = asyncio.create_task(_pump(requests, call))
            try:
                async with contextlib.aclosing(self._relay(context, call, member, reply)) as replies:
                    async for raw in replies:
                        yield raw
            finally:
                pump.cancel()

    async def Generate(self, raw: bytes, context):
        request = _parse(pb.GenerateRequest, raw)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable GenerateRequest")
        metadata = self._upstream_metadata(context)
        async with self._admitted(context, list(request.prompt_ids), request.params):
            call, member, reply = await self._open(
                context, list(request.prompt_ids),
                lambda m: m.channel.unary_stream(VERIFIER_METHOD + "Generate")(raw, metadata=metadata))
            async with contextlib.aclosing(self._relay(context, call, member, reply)) as replies:
                async for piece in replies:
                    yield piece

    async def _relay(self, context, call, member: Member, reply: bytes):
        """The verifier's replies, from its first, ended as the verifier ended them. Close it (aclosing) so
        that the upstream call ends with the client's, not when the generator is collected."""
        try:
            yield reply
            while (raw := await call.read()) is not grpc.aio.EOF:
                yield raw
        except grpc.aio.AioRpcError as e:
            await self._end_like_upstream(context, member, e)
        finally:
            call.cancel()
            member.relayed -= 1

    async def _open(self, context, prompt: list[int], start_call, first: bytes | None = None):
        """Place the session and start its call; (call, member, the verifier's first reply). A verifier that
        fails before answering is suspect; the session goes to the next one."""
        tried: set[str] = set()
        while True:
            try:
                member, placement = self.fleet.place(prompt, exclude=tried)
            except NoVerifier as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; try again")
            self.metrics.placements.labels(member.address, placement.reason).inc()
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.cached_tokens.inc(placement.cached_tokens)
            call = start_call(member)
            member.relayed += 1
            try:
                if first is not None:
                    await call.write(first)
                reply, error = await call.read(), None
            except grpc.aio.AioRpcError as e:
                reply, error = None, e
            except BaseException:  # the client went away while the verifier prefilled
                member.relayed -= 1
                call.cancel()
                raise
            if reply is not grpc.aio.EOF and error is None:
                return call, member, reply
            member.relayed -= 1
            call.cancel()
            if error is None:
                await context.abort(grpc.StatusCode.INTERNAL, f"verifier {member.address} ended the stream unanswered")
            if error.code() != grpc.StatusCode.UNAVAILABLE:  # the verifier's answer to this request
                await self._end_like_upstream(context, member, error)
            if not _told_to_move(error):  # down, not draining
                self._failed(member)
            tried.add(member.address)
            if len(tried) >= MAX_PLACEMENTS:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{len(tried)} verifiers failed to take the session",
                                    ((wire.MIGRATE, "1"),))

    async def _end_like_upstream(self, context, member: Member, error: grpc.aio.AioRpcError) -> None:
        trailing = tuple(error.trailing_metadata() or ())
        if error.code() == grpc.StatusCode.UNAVAILABLE and not _told_to_move(error):
            self._failed(member)  # it went away mid-stream: the client moves through this router at once
            trailing += ((wire.MIGRATE, "1"),)
        await context.abort(error.code(), error.details() or "", trailing)

    def _failed(self, member: Member) -> None:
        if not member.draining:
            self.fleet.suspect(member)
            self.metrics.relay_failures.labels(member.address).inc()

    async def _any(self, context) -> Member:
        pool = self.fleet.pool()
        if not pool:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier is serving; try again")
        return min(pool, key=lambda m: m.load_score)

    # ---- the Router service -------------------------------------------------------------------------

    async def Register(self, raw: bytes, context) -> bytes:
        request = _parse(rpb.RegisterRequest, raw)
        if request is None or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Register needs the verifier's address")
        if request.leaving:
            member = self.fleet.members.get(request.address)
            if member is not None:
                member.draining = True
            return rpb.RegisterReply().SerializeToString()
        lease = request.lease_s if request.lease_s > 0 else self.fleet.config.lease_s
        self.fleet.register(request.address, lease)
        return rpb.RegisterReply(renew_s=lease / 3).SerializeToString()

    async def Drain(self, raw: bytes, context) -> bytes:
        request = _parse(rpb.DrainVerifierRequest, raw)
        member = None if request is None else self.fleet.members.get(request.address)
        if member is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no verifier {getattr(request, 'address', '')!r} here")
        member.draining = True
        try:
            reply = pb.DrainReply.FromString(await member.channel.unary_unary(VERIFIER_METHOD + "Drain")(
                pb.DrainRequest().SerializeToString(), metadata=self.fleet.metadata, timeout=10))
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"verifier {member.address}: {e.details()}")
        log.info('{"event": "drain", "address": "%s", "sessions": %d}', member.address, reply.sessions)
        return rpb.DrainVerifierReply(sessions=reply.sessions).SerializeToString()

    async def Explain(self, raw: bytes, context) -> bytes:
        request = _parse(rpb.ExplainRequest, raw)
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable ExplainRequest")
        fleet = self.fleet
        candidates = fleet.candidates(list(request.prompt_ids))
        try:
            chosen = place(candidates, fleet.config.policy, fleet.config.balance_threshold, fleet.turn)
        except NoVerifier as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return rpb.Explanation(address=chosen.address, reason=chosen.reason, candidates=[
            rpb.CandidateScore(address=c.address, load=c.load, cached_tokens=c.cached_tokens)
            for c in candidates]).SerializeToString()

    async def ListVerifiers(self, raw: bytes, context) -> bytes:
        return rpb.VerifierList(verifiers=[
            rpb.VerifierStatus(address=m.address, healthy=m.healthy and m.watching,
                               draining=m.draining or m.load.draining, registered=m.registered,
                               active_sessions=m.load.active_sessions,
                               waiting=m.load.waiting, kv_used=m.load.kv_used,
                               cached_blocks=self.fleet.index.blocks(m.address))
            for m in self.fleet.members.values()]).SerializeToString()


async def _pump(requests, call) -> None:
    """The client's messages after the first, to the verifier; then its half-close."""
    try:
        async for raw in requests:
            await call.write(raw)
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the verifier's side ended: the relay reports its status


def _told_to_move(error: grpc.aio.AioRpcError) -> bool:
    return any(key == wire.MIGRATE for key, _ in error.trailing_metadata() or ())


def _parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except Exception:  # DecodeError: the caller answers INVALID_ARGUMENT
        return None
