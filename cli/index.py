"""`specedge index build PATH... -o STORE`: a long-term datastore for retrieval drafting."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    build.add_argument("--model", default="smollm2-135m", help="model whose tokenizer the datastore uses")
    build.set_defaults(run=run_build)


def run_build(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from specedge.common.model_registry import resolve_model_dir
    from specedge.edge.corpus import build_datastore

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
        build_datastore(args.paths, tokenizer, args.out)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"specedge index build: {e}")
    return 0
