"""`specedge router`: one address for a fleet of verifiers (cloud/router/), and `specedge router drain` /
`specedge router list` for operators. The router's flags are the fields of RouterConfig."""

from __future__ import annotations

import argparse
import logging

import grpc

from specedge.cli.flags import add_config_flags, add_tls_flags, config_from_args, tls_channel
from specedge.cloud.router.config import RouterConfig


def add_parser(commands) -> None:
    r = commands.add_parser(
        "router", help="route edge sessions across verifiers",
        description="Serve the Verifier service for a fleet of verifiers: each session goes to the verifier "
        "whose prefix cache holds most of its prompt, unless that one is much busier than the least-loaded; "
        "dead verifiers leave the pool within seconds and their sessions move. Subcommands talk to a running "
        "router.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(r, RouterConfig)
    r.set_defaults(run=run)
    actions = r.add_subparsers(dest="action", metavar="ACTION", help="without one, run the router")
    d = actions.add_parser("drain", help="move a verifier's live sessions to the others and place none on it")
    d.add_argument("address", help="the verifier, host:port as the router knows it")
    l_ = actions.add_parser("list", help="the router's verifiers and their state")
    for sub in (d, l_):
        sub.add_argument("--router", default="127.0.0.1:50050", help="the router, host:port")
        sub.add_argument("--auth-token", default=None, help="the router's bearer token")
        add_tls_flags(sub, "the router")
        sub.set_defaults(run=run_action)


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.router.server import route_forever

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = config_from_args(RouterConfig, args)
    try:
        route_forever(config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"specedge router: {e}")
    return 0


def run_action(args: argparse.Namespace) -> int:
    from specedge.protos import router_pb2 as rpb

    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else []
    with tls_channel(args, args.router) as channel:
        try:
            if args.action == "drain":
                drain = channel.unary_unary("/specedge.v1.Router/Drain",
                                            request_serializer=rpb.DrainVerifierRequest.SerializeToString,
                                            response_deserializer=rpb.DrainVerifierReply.FromString)
                reply = drain(rpb.DrainVerifierRequest(address=args.address), metadata=metadata, timeout=30)
                print(f"draining {args.address}: {reply.sessions} live sessions are moving to other verifiers")
            else:
                listing = channel.unary_unary("/specedge.v1.Router/ListVerifiers",
                                              request_serializer=rpb.ListVerifiersRequest.SerializeToString,
                                              response_deserializer=rpb.VerifierList.FromString)
                for v in listing(rpb.ListVerifiersRequest(), metadata=metadata, timeout=10).verifiers:
                    state = "draining" if v.draining else "healthy" if v.healthy else "down"
                    print(f"{v.address}\t{state}\tsessions={v.active_sessions}\twaiting={v.waiting}\t"
                          f"kv_used={v.kv_used:.0%}\tcached_blocks={v.cached_blocks}"
                          f"{'' if v.registered else chr(9) + 'static'}")
        except grpc.RpcError as e:
            raise SystemExit(f"specedge router {args.action}: {e.code().name}: {e.details()}")
    return 0
