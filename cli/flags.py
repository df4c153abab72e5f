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
