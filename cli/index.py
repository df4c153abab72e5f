"""`specedge index build PATH... -o STORE`: a long-term datastore for retrieval drafting."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

from specedge.cli.flags import add_tls_flags, channel_config
from specedge.cloud.config import DEFAULT_MODEL


def add_parser(commands) -> None:
    index = commands.add_parser("index", help="build long-term datastores for retrieval drafting",
                                description="Long-term datastores for --drafter retrieval --corpus STORE.")
    actions = index.add_subparsers(dest="action", required=True, metavar="ACTION", help="what to do")
    build = actions.add_parser(
        "build", help="tokenise files and build a suffix-array datastore",
        description="Tokenise text files (directories recursively; .jsonl files line by line, e.g. past "
        "outputs) with the model's tokenizer and build a memory-mapped suffix-array datastore.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    build.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files or directories to index")
    build.add_argument("-o", "--out", type=Path, required=True, help="directory to write the datastore to")
    build.add_argument("--model", default=DEFAULT_MODEL, help="model whose tokenizer the datastore uses")
    build.add_argument("--server", default=None, metavar="HOST:PORT",
                       help="take the tokenizer from this verifier instead of loading --model (the edge's way)")
    build.add_argument("--auth-token", default=None, help="bearer token for --server")
    add_tls_flags(build, "--server")
    build.set_defaults(run=run_build)


def run_build(args: argparse.Namespace) -> int:
    from specedge.edge.corpus import build_datastore

    try:
        build_datastore(args.paths, _tokenizer(args), args.out)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"specedge index build: {e}")
    except grpc.RpcError as e:
        raise SystemExit(f"specedge index build: cannot use --server {args.server}: {e.code().name}: {e.details()}")
    return 0


def _tokenizer(args: argparse.Namespace):
    from specedge.edge.tokenizer import EdgeTokenizer

    if args.server is not None:
        from specedge.edge.tokenizer_cache import verifier_tokenizer
        from specedge.edge.transport import RemoteVerifier

        verifier = RemoteVerifier(args.server, channel_config(args))
        try:
            return verifier_tokenizer(verifier)
        finally:
            verifier.close()
    from transformers import AutoTokenizer

    from specedge.cloud.model_registry import resolve_model_dir

    return EdgeTokenizer.from_transformers(AutoTokenizer.from_pretrained(resolve_model_dir(args.model)))
