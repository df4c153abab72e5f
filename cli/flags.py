"""Command-line flags from a configuration dataclass: one flag per field, with the field's default and the
help written beside it, so that a default is never written twice."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def add_config_flags(parser: argparse.ArgumentParser, config_class) -> None:
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # `X | None`: the flag takes an X
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"])


def config_from_args(config_class, args: argparse.Namespace):
    return config_class(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)})


def add_tls_flags(parser: argparse.ArgumentParser, whom: str) -> None:
    """--tls-ca, --tls-cert, --tls-key and --tls-server-name of a command that calls `whom` over gRPC."""
    parser.add_argument("--tls-ca", default=None, help=f"PEM CA of {whom}'s certificate: connect with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate, for mutual TLS")
    parser.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help=f"the name {whom}'s certificate holds, where it "
                        "differs from the address dialled")


def tls_channel(args: argparse.Namespace, target: str):
    """A blocking gRPC channel to `target` by the flags of `add_tls_flags` (SystemExit on a bad pair)."""
    from specedge.common import tls

    try:
        tls.check_files("--tls-cert/--tls-key", args.tls_cert, args.tls_key, args.tls_ca, needs_ca=True)
    except ValueError as e:
        raise SystemExit(f"specedge: {e}")
    return tls.channel(target, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def channel_config(args: argparse.Namespace):
    """An edge's ChannelConfig from --auth-token and the flags of `add_tls_flags` (ValueError on a bad pair)."""
    from specedge.common import tls
    from specedge.edge.transport import ChannelConfig

    tls.check_files("--tls-cert/--tls-key", args.tls_cert, args.tls_key, args.tls_ca, needs_ca=True)
    return ChannelConfig(auth_token=args.auth_token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, server_name=args.tls_server_name)
