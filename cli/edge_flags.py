"""The flags of the commands that run an edge client (`generate`, `edge-serve`), and the client they make:
against the verifiers given by --server, or one started on loopback in this process."""

from __future__ import annotations

import argparse
from pathlib import Path

from specedge.cli.flags import add_tls_flags, channel_config
from specedge.cloud.config import DEFAULT_MODEL, ServerConfig
from specedge.common.tree_sizing import MAX_TREE_NODES


def add_edge_flags(parser: argparse.ArgumentParser, default_drafter: str) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name (smollm2-135m, gemma3-270m) or a "
                        "local Hugging Face model directory, for the embedded verifier (without --server)")
    parser.add_argument("--drafter", default=default_drafter, help="draft source: none (plain decoding), retrieval "
                        "(matches in the prompt, the output so far and --corpus, and the verifier's own recycled "
                        "predictions), model:NAME (a small model on this device: smollm2-135m, gemma3-270m or a "
                        ".gguf path; any vocabulary), or hybrid[:NAME] (retrieval and a model in one tree)")
    parser.add_argument("--no-hints", action="store_true", help="do not ask the verifier for its top tokens at "
                        "each verified position (the drafter then drafts from retrieval alone)")
    parser.add_argument("--no-overlap", action="store_true", help="never send a tree ahead of the verdict in "
                        "flight (by default one goes out where that pays more than waiting a round trip for "
                        "the verdict)")
    parser.add_argument("--no-fill", action="store_true", help="do not let the verifier add its own draft to what "
                        "is left of a tree sent ahead once the verdict before it is known (by default it does, "
                        "from the session's own text: it knows that verdict's last token, the edge did not)")
    parser.add_argument("--corpus", action="append", type=Path, default=[], metavar="PATH",
                        help="files or directories for the long-term datastore, or a datastore built with "
                        "`specedge index build` (repeatable); built once and cached")
    parser.add_argument("--max-tree", type=int, default=MAX_TREE_NODES,
                        help="most draft-tree nodes per verification pass")
    parser.add_argument("--server", action="append", default=None, metavar="HOST:PORT",
                        help="verifier to use (repeat the flag for fail-over targets); default: an embedded one")
    parser.add_argument("--auth-token", default=None, help="bearer token for the verifier")
    add_tls_flags(parser, "the verifier (or router)")
    parser.add_argument("--kv-pool-mb", type=int, default=ServerConfig.kv_pool_mb,
                        help="KV cache budget of the embedded verifier in MiB")


def edge_client(args: argparse.Namespace, engine_thread: bool):
    """(EdgeClient, EmbeddedVerifier or None) from the flags; ValueError/FileNotFoundError on bad values.
    `engine_thread`: the embedded verifier steps its engine on a thread of its own (a server); else the
    caller runs the steps with `run_engine_while` (one job, faster when this thread loaded the model)."""
    from specedge.edge.client import EdgeClient
    from specedge.edge.registry import check_drafter

    check_drafter(args.drafter, bool(args.corpus))  # before the slow model load
    if args.max_tree < 0:
        raise ValueError(f"--max-tree must be >= 0, got {args.max_tree}")
    channel = channel_config(args)
    embedded, tokenizer = None, None
    if args.server is None:
        try:
            from specedge.cloud.launch import EmbeddedVerifier
            from specedge.cloud.model_registry import load_model
        except ImportError as e:
            raise ValueError(f"no --server given, and this install cannot run a verifier itself ({e}); "
                             "give --server HOST:PORT, or install specedge[verifier]")
        hf, tokenizer = load_model(args.model)
        embedded = EmbeddedVerifier(ServerConfig(model=args.model, port=0, kv_pool_mb=args.kv_pool_mb,
                                                 auth_token=args.auth_token), (hf, tokenizer),
                                    scheduler_thread=engine_thread)
        targets = [embedded.target]
    else:
        targets = args.server
    try:
        client = EdgeClient(targets, drafter=args.drafter, tokenizer=tokenizer, corpus=args.corpus or None,
                            channel=channel, max_tree=args.max_tree, hints=not args.no_hints,
                            overlap=not args.no_overlap, fill=not args.no_fill)
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise
    return client, embedded
