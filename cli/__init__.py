"""The `specedge` command. `specedge --help` lists the subcommands; each lives in its own module here."""

from __future__ import annotations

import argparse

from specedge.cli import bench, edge_serve, generate, health, index, proxy, ray, router, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specedge",
        description="Edge-cloud speculative decoding: edge clients draft, verifiers check drafts losslessly.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, edge_serve, serve, router, proxy, health, ray, index, bench):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
