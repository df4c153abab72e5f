"""The verifier's gRPC server: the Verifier service (cloud/service.py) with bearer-token auth, TLS or mutual
TLS, health checking, reflection and Prometheus metrics, and a graceful drain."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specedge.cloud.auth import BearerAuth, accepted_tokens
from specedge.cloud.config import ServerConfig
from specedge.cloud.router.registration import Registration
from specedge.cloud.service import ServedModel, VerifierService, log_event
from specedge.common import tls
from specedge.protos import verifier_pb2 as pb

SERVICE = "specedge.v1.Verifier"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    service: VerifierService
    health: health.HealthServicer
    port: int

    registration: Registration | None = None

    async def stop(self, grace_s: float = 10.0, migrate: bool | None = None) -> None:
        """Graceful: refuse new sessions and report NOT_SERVING, let open sessions finish (or, `migrate`,
        move them to other verifiers at their next round boundary), then stop. A verifier registered with a
        router leaves its fleet first and migrates unless told otherwise."""
        if migrate is None:
            migrate = self.registration is not None
        if self.registration is not None:
            await self.registration.leave()
        live = lambda: sum(self.service.sessions_by_client.values())  # noqa: E731
        log_event("stopping", sessions=live(), grace_s=grace_s, migrate=migrate)
        if migrate:
            self.service.drain()
        else:
            self.service.draining = True
            self.not_serving()
        started = time.monotonic()
        deadline = started + grace_s
        while self.service.sessions_by_client and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = live()  # cut off when the server stops below
        self.service.cache_watchers.close()  # routers' watches are no sessions: they end now, not at the grace
        await self.server.stop(grace=max(0.0, deadline - time.monotonic()))
        self.service.scheduler.stop()
        log_event("stopped", seconds=round(time.monotonic() - started, 3), sessions_cut_off=left)

    def not_serving(self) -> None:
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def advertised_address(config: ServerConfig, port: int) -> str:
    """host:port a router reaches this verifier at: --advertise (its port is the bound one when it names a host
    only), else the listening host."""
    if config.advertise:
        return config.advertise if ":" in config.advertise else f"{config.advertise}:{port}"
    return f"{config.host}:{port}"


def check_tls(config: ServerConfig) -> None:
    """A ValueError that names the flag, for TLS files given by halves, without what they need, or missing."""
    tls.check_serving(config.tls_cert, config.tls_key, config.tls_client_ca)
    tls.check_files("--register-tls-ca", None, None, config.register_tls_ca)
    if config.register_tls_ca and not config.register:
        raise ValueError("--register-tls-ca is for the router of --register, which is not given")


async def start_server(model: ServedModel, config: ServerConfig, scheduler_thread: bool = True) -> RunningServer:
    """Serve `model`; with `scheduler_thread=False` the caller runs `service.scheduler.run()` itself."""
    check_tls(config)
    service = VerifierService(model, config, scheduler_thread)
    tokens = accepted_tokens(config.auth_token, service.identities.tokens)
    interceptors = [BearerAuth(tokens, (f"/{SERVICE}/",))] if tokens else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", 16 << 20), ("grpc.so_reuseport", 0)])
    handlers = {
        "GetInfo": grpc.unary_unary_rpc_method_handler(service.GetInfo),
        "GetTokenizer": grpc.unary_stream_rpc_method_handler(service.GetTokenizer),
        "Session": grpc.stream_stream_rpc_method_handler(service.Session),
        "Generate": grpc.unary_stream_rpc_method_handler(service.Generate),
        "WatchCache": grpc.unary_stream_rpc_method_handler(service.WatchCache),
        "Drain": grpc.unary_unary_rpc_method_handler(service.Drain),
        "FlushCache": grpc.unary_unary_rpc_method_handler(service.FlushCache),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["Verifier"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    port = tls.add_port(server, address, config.tls_cert, config.tls_key, config.tls_client_ca)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.metrics_port is not None:
        service.metrics.serve(config.metrics_port, config.host)
    log_event("serving", address=f"{config.host}:{port}", model=config.model, tls=bool(config.tls_cert),
             auth=bool(tokens), kv_blocks=model.engine.pool.num_blocks)
    running = RunningServer(server, service, health_servicer, port)
    if config.register:
        metadata = (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else ()
        channel = tls.aio_channel(config.register, config.register_tls_ca, config.tls_cert, config.tls_key)
        running.registration = Registration(channel, config.register, advertised_address(config, port), metadata)
    service.on_drain.append(running.not_serving)
    return running
