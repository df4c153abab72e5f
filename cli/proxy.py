"""`specedge proxy`: a TCP proxy that emulates the network between edge and cloud (netem/proxy.py)."""

from __future__ import annotations

import argparse
import logging

from specedge.cli.flags import add_config_flags, config_from_args
from specedge.netem.proxy import NetworkConditions


def add_parser(commands) -> None:
    p = commands.add_parser(
        "proxy", help="emulate a network between edge and cloud",
        description="Relay TCP connections (gRPC included) from --listen to --upstream with one-way delay, "
        "jitter, a bandwidth limit and faults (resets, stalls), each direction.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:50060", help="host:port to accept connections on")
    p.add_argument("--upstream", required=True, help="host:port to relay them to (a router or a verifier)")
    add_config_flags(p, NetworkConditions)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.netem.proxy import run_proxy

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        conditions = config_from_args(NetworkConditions, args)
    except ValueError as e:
        raise SystemExit(f"specedge proxy: {e}")
    run_proxy(args.listen, args.upstream, conditions)
    return 0
