"""A verifier's membership in a router's fleet (`specedge serve --register ROUTER`): a lease renewed by
heartbeat while it serves, and a goodbye when it drains, so that the router stops placing sessions on it
before its live ones move."""

from __future__ import annotations

import asyncio
import logging

import grpc

from specedge.protos import router_pb2 as rpb

log = logging.getLogger("specedge.server")

LEASE_S = 3.0  # the router drops a verifier that has not renewed for this long


class Registration:
    def __init__(self, channel: grpc.aio.Channel, router: str, address: str, metadata: tuple = ()) -> None:
        """`channel`: to the router at `router` (common/tls.py: over TLS where the router serves it)."""
        self.router, self.address, self.metadata = router, address, metadata
        self._channel = channel
        self._register = self._channel.unary_unary("/specedge.v1.Router/Register",
                                                   request_serializer=rpb.RegisterRequest.SerializeToString,
                                                   response_deserializer=rpb.RegisterReply.FromString)
        self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        renew_s, joined = LEASE_S / 3, False
        while True:
            try:
                reply = await self._register(rpb.RegisterRequest(address=self.address, lease_s=LEASE_S),
                                             metadata=self.metadata, timeout=LEASE_S / 3)
                renew_s = reply.renew_s or renew_s
                if not joined:
                    log.info('{"event": "registered", "router": "%s", "address": "%s"}', self.router, self.address)
                joined = True
            except grpc.aio.AioRpcError as e:  # the router is down or restarting: keep trying
                if joined:
                    log.warning('{"event": "register_failed", "router": "%s", "code": "%s"}', self.router,
                                e.code().name)
                joined = False
            await asyncio.sleep(renew_s)

    def cancel(self) -> None:
        """Stop renewing: the lease runs out."""
        self._task.cancel()

    async def leave(self) -> None:
        """Stop renewing and tell the router this verifier is going (best effort)."""
        self.cancel()
        try:
            await self._register(rpb.RegisterRequest(address=self.address, leaving=True), metadata=self.metadata,
                                 timeout=2)
        except grpc.aio.AioRpcError:
            pass
        await self._channel.close()
