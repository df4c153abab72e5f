"""`specedge serve`: a verifier node. Its flags are the fields of ServerConfig (cloud/config.py), with the
defaults and help written there."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing

from specedge.cloud.config import ServerConfig


def add_parser(commands) -> None:
    s = commands.add_parser(
        "serve", help="start a verifier (gRPC)",
        description="Serve a model as a specedge verifier: edge clients open sessions, send draft trees and get "
        "the accepted tokens; sessions are batched into shared engine steps over one paged KV pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # `X | None`: the flag takes an X
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        s.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"])
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.launch import serve_forever

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("specedge serve: --tls-cert and --tls-key go together")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    try:
        serve_forever(config)
    except (ValueError, OSError) as e:
        raise SystemExit(f"specedge serve: {e}")
    return 0
