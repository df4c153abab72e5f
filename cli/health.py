"""`specedge health HOST:PORT`: a gRPC health probe (exit 0 when SERVING), for container health checks
(`grpc_health_probe` is a separate binary; this one comes with the package)."""

from __future__ import annotations

import argparse

import grpc

from specedge.cli.flags import add_tls_flags, tls_channel


def add_parser(commands) -> None:
    h = commands.add_parser("health", help="probe a verifier's or router's gRPC health (exit 0: serving)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    h.add_argument("address", help="host:port of the service")
    h.add_argument("--service", default="", help="the service to ask about ('' = the server as a whole)")
    h.add_argument("--timeout-s", type=float, default=2.0, help="give up (exit 1) after this long")
    add_tls_flags(h, "the service")
    h.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tls_channel(args, args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                             timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
