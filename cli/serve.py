"""`specedge serve`: a verifier node. Its flags are the fields of ServerConfig (cloud/config.py), with the
defaults and help written there."""

from __future__ import annotations

import argparse
import logging

from specedge.cli.flags import add_config_flags, config_from_args
from specedge.cloud.config import ServerConfig


def add_parser(commands) -> None:
    s = commands.add_parser(
        "serve", help="start a verifier (gRPC)",
        description="Serve a model as a specedge verifier: edge clients open sessions, send draft trees and get "
        "the accepted tokens; sessions are batched into shared engine steps over one paged KV pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_flags(s, ServerConfig)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.launch import serve_forever

    from specedge.cloud.server import check_tls

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = config_from_args(ServerConfig, args)
    try:
        check_tls(config)  # before the model loads
        serve_forever(config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"specedge serve: {e}")
    return 0
