"""Fleet: the verifiers a router knows, whether each is in the pool, its load and its prefix cache.

A verifier is in the pool while it answers gRPC health checks (every `health_interval_s`, at most
`health_timeout_s` each), its WatchCache stream is up, it is not draining, and (if it registered) its
lease holds. A killed verifier drops its stream: it leaves the pool and the affinity index at once; a hung
one fails its health check within interval + timeout. It comes back, with a fresh snapshot, when healthy.
Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specedge.cloud.router.affinity_index import AffinityIndex
from specedge.cloud.router.config import RouterConfig
from specedge.cloud.router.placement import Candidate, Placement, place
from specedge.common import tls
from specedge.protos import verifier_pb2 as pb

log = logging.getLogger("specedge.router")

VERIFIER = "specedge.v1.Verifier"
RECONNECT_S = 0.25  # between attempts to reopen a verifier's WatchCache stream
KV_WEIGHT = 4.0  # a full KV pool weighs as much as the default balance threshold: new prefills would wait


@dataclass
class Member:
    address: str
    channel: grpc.aio.Channel
    registered: bool = False
    lease_until: float | None = None
    healthy: bool = False
    watching: bool = False  # its WatchCache stream is up (the index knows its cache)
    draining: bool = False  # told to drain by this router
    refused: str | None = None  # why it cannot join (another model)
    load: pb.Load = field(default_factory=pb.Load)
    placed: int = 0
    relayed: int = 0  # sessions relayed to it now by this router
    relayed_at_report: int = 0  # ... when its last load report came
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def in_pool(self) -> bool:
        return self.healthy and self.watching and not (self.draining or self.load.draining or self.refused)

    @property
    def load_score(self) -> float:
        """Sessions and queued requests, plus KV_WEIGHT for a KV pool full of sessions' blocks."""
        # This router's own sessions it knows now; others' (other routers', direct clients') only from the
        # last report, which lags by up to a report interval.
        others = max(0, self.load.active_sessions - self.relayed_at_report)
        return others + self.relayed + self.load.waiting + KV_WEIGHT * self.load.kv_used


class Fleet:
    def __init__(self, config: RouterConfig, metadata: tuple = ()) -> None:
        self.config = config
        self.metadata = metadata  # sent to verifiers (their bearer token)
        self.members: dict[str, Member] = {}
        self.index = AffinityIndex()
        self.fingerprint: str | None = None  # of the first verifier's tokenizer: every member must share it
        self.turn = 0  # placements so far (round-robin counts by it)

    def add(self, address: str, registered: bool = False) -> Member:
        member = self.members.get(address)
        if member is None:
            c = self.config
            channel = tls.aio_channel(address, c.verifier_tls_ca, c.verifier_tls_cert, c.verifier_tls_key,
                                      c.verifier_tls_server_name)
            member = Member(address, channel, registered=registered)
            self.members[address] = member
            member.tasks = [asyncio.create_task(self._check_health(member)),
                            asyncio.create_task(self._watch(member))]
            log.info('{"event": "verifier_added", "address": "%s", "registered": %s}', address,
                     str(registered).lower())
        return member

    def register(self, address: str, lease_s: float) -> None:
        member = self.add(address, registered=True)
        member.registered = True
        member.lease_until = time.monotonic() + lease_s
        member.draining = False

    async def remove(self, address: str) -> None:
        member = self.members.pop(address, None)
        if member is None:
            return
        self.index.forget(address)
        for task in member.tasks:
            task.cancel()
        await member.channel.close()
        log.info('{"event": "verifier_removed", "address": "%s"}', address)

    def pool(self) -> list[Member]:
        return [m for m in self.members.values() if m.in_pool]

    def candidates(self, prompt_ids: list[int], exclude: set[str] = frozenset()) -> list[Candidate]:
        members = [m for m in self.pool() if m.address not in exclude]
        cached = self.index.cached_tokens([m.address for m in members], prompt_ids)
        return [Candidate(m.address, m.load_score, cached[m.address], m.placed) for m in members]

    def place(self, prompt_ids: list[int], exclude: set[str] = frozenset()) -> tuple[Member, Placement]:
        """The member for a new session (NoVerifier if none is in the pool)."""
        placement = place(self.candidates(prompt_ids, exclude), self.config.policy, self.config.balance_threshold,
                          self.turn)
        self.turn += 1
        member = self.members[placement.address]
        self.index.expect(member.address, prompt_ids)
        member.placed += 1
        return member, placement

    def suspect(self, member: Member) -> None:
        """A call to it failed as if it were down: out of the pool until its next good health check."""
        member.healthy = False

    async def close(self) -> None:
        for address in list(self.members):
            await self.remove(address)

    # ---- per member ---------------------------------------------------------------------------------

    async def _check_health(self, member: Member) -> None:
        stub = health_pb2_grpc.HealthStub(member.channel)
        c = self.config
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=VERIFIER), timeout=c.health_timeout_s)
                healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                healthy = False
            if healthy != member.healthy:
                log.info('{"event": "verifier_%s", "address": "%s"}', "healthy" if healthy else "unhealthy",
                         member.address)
            member.healthy = healthy
            if member.registered and member.lease_until is not None and time.monotonic() > member.lease_until:
                log.info('{"event": "lease_expired", "address": "%s"}', member.address)
                asyncio.create_task(self.remove(member.address))
                return
            await asyncio.sleep(c.health_interval_s)

    async def _watch(self, member: Member) -> None:
        watch = member.channel.unary_stream("/specedge.v1.Verifier/WatchCache")
        info = member.channel.unary_unary("/specedge.v1.Verifier/GetInfo")
        while True:
            try:
                if member.refused is None:
                    self._check_model(member, pb.VerifierInfo.FromString(
                        await info(pb.GetInfoRequest().SerializeToString(), metadata=self.metadata, timeout=10)))
                call = watch(pb.WatchCacheRequest().SerializeToString(), metadata=self.metadata)
                async for raw in call:
                    update = pb.CacheUpdate.FromString(raw)
                    if update.snapshot:
                        self.index.replace(member.address, update.block_size, update.stored)
                        member.watching = True
                    else:
                        self.index.update(member.address, update.stored, update.removed)
                    member.load, member.relayed_at_report = update.load, member.relayed
            except grpc.aio.AioRpcError:
                pass
            member.watching = False
            self.index.forget(member.address)
            await asyncio.sleep(RECONNECT_S)

    def _check_model(self, member: Member, info: pb.VerifierInfo) -> None:
        if self.fingerprint is None:
            self.fingerprint = info.tokenizer_fingerprint
        elif info.tokenizer_fingerprint != self.fingerprint:
            member.refused = (f"serves {info.model} (tokenizer {info.tokenizer_fingerprint}), not the fleet's "
                              f"tokenizer {self.fingerprint}")
            log.warning('{"event": "verifier_refused", "address": "%s", "why": "%s"}', member.address, member.refused)
