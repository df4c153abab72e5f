"""Starting a router: its gRPC server (the relayed Verifier service, the Router service, health checking)
and its fleet of verifiers."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specedge.cloud.auth import BearerAuth, accepted_tokens
from specedge.cloud.identity import Identities, read_token_file
from specedge.cloud.router.config import RouterConfig
from specedge.cloud.router.fleet import Fleet
from specedge.cloud.router.metrics import RouterMetrics
from specedge.cloud.router.placement import POLICIES
from specedge.cloud.router.service import RouterService
from specedge.common import tls

log = logging.getLogger("specedge.router")


@dataclass
class RunningRouter:
    server: grpc.aio.Server
    fleet: Fleet
    port: int
    service: RouterService

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace=grace_s)
        await self.fleet.close()


def check_config(config: RouterConfig) -> None:
    """A ValueError that names the flag, for an unknown policy or TLS files given by halves or missing."""
    if config.policy not in POLICIES:
        raise ValueError(f"unknown placement policy {config.policy!r}; choose from {', '.join(POLICIES)}")
    tls.check_serving(config.tls_cert, config.tls_key, config.tls_client_ca)
    tls.check_files("--verifier-tls-cert/--verifier-tls-key", config.verifier_tls_cert, config.verifier_tls_key,
                    config.verifier_tls_ca, needs_ca=True)


async def start_router(config: RouterConfig) -> RunningRouter:
    check_config(config)
    metadata = (("authorization", f"Bearer {config.verifier_auth_token}"),) if config.verifier_auth_token else ()
    fleet = Fleet(config, metadata)
    metrics = RouterMetrics()
    identities = Identities(read_token_file(config.auth_tokens) if config.auth_tokens else {})
    service = RouterService(fleet, metrics, identities)
    tokens = accepted_tokens(config.auth_token, identities.tokens)
    interceptors = [BearerAuth(tokens, ("/specedge.v1.Verifier/", "/specedge.v1.Router/"))] if tokens else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", 16 << 20), ("grpc.so_reuseport", 0)])
    unary, stream, both = (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler,
                           grpc.stream_stream_rpc_method_handler)
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("specedge.v1.Verifier", {
            "GetInfo": unary(service.GetInfo), "GetTokenizer": stream(service.GetTokenizer),
            "Session": both(service.Session), "Generate": stream(service.Generate)}),
        grpc.method_handlers_generic_handler("specedge.v1.Router", {
            "Register": unary(service.Register), "Drain": unary(service.Drain),
            "ListVerifiers": unary(service.ListVerifiers), "Explain": unary(service.Explain)}),
    ))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    listen = f"{config.host}:{config.port}"
    port = tls.add_port(server, listen, config.tls_cert, config.tls_key, config.tls_client_ca)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    for address in filter(None, (a.strip() for a in config.verifiers.split(","))):
        fleet.add(address)
    for name in ("", "specedge.v1.Verifier", "specedge.v1.Router"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.metrics_port is not None:
        metrics.serve(config.metrics_port, config.host)
        asyncio.create_task(_observe_fleet(fleet, metrics))
    log.info(json.dumps({"event": "routing", "address": f"{config.host}:{port}", "policy": config.policy,
                         "tls": bool(config.tls_cert), "verifiers_tls": bool(config.verifier_tls_ca),
                         "verifiers": sorted(fleet.members)}))
    return RunningRouter(server, fleet, port, service)


async def _observe_fleet(fleet: Fleet, metrics: RouterMetrics) -> None:
    while True:
        in_pool = len(fleet.pool())
        metrics.verifiers.labels("in_pool").set(in_pool)
        metrics.verifiers.labels("out").set(len(fleet.members) - in_pool)
        await asyncio.sleep(1.0)


def route_forever(config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM."""

    async def main() -> None:
        running = await start_router(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop()

    asyncio.run(main())


class EmbeddedRouter:
    """A real router on loopback, run on a background thread of this process (tests and benchmarks)."""

    def __init__(self, config: RouterConfig) -> None:
        config = replace(config, host="127.0.0.1")
        self.loop = asyncio.new_event_loop()
        started: dict = {}
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                started["router"] = self.loop.run_until_complete(start_router(config))
            except BaseException as e:  # re-raised on the constructor's thread
                started["error"] = e
            ready.set()
            if "router" in started:
                self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="embedded-router", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in started:
            raise started["error"]
        self.running: RunningRouter | None = started["router"]
        self.target = f"127.0.0.1:{self.running.port}"

    @property
    def fleet(self) -> Fleet:
        return self.running.fleet

    def call(self, fn):
        """Run `fn()` on the router's event loop (its state belongs to that thread); its result."""

        async def on_loop():
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(timeout=30)

    def stop(self) -> None:
        if self.running is None:
            return
        asyncio.run_coroutine_threadsafe(self.running.stop(grace_s=0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.running = None

    def __enter__(self) -> EmbeddedRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
