"""`specedge generate PROMPT`: one generation, against a verifier given by --server or one started on
loopback in this process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specedge.cloud.config import DEFAULT_MODEL, ServerConfig
from specedge.common.params import SamplingParams
from specedge.common.tree_sizing import MAX_TREE_NODES


def add_parser(commands) -> None:
    sampling = SamplingParams()
    gen = commands.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt: the edge drafts, a verifier checks the drafts over gRPC. "
        "With --server it uses that verifier; without, it starts one on loopback in this process. Greedy "
        "output equals transformers' generate token for token; sampled output follows the model's distribution.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="registry name (smollm2-135m, gemma3-270m) or a local "
                     "Hugging Face model directory")
    gen.add_argument("--drafter", default="none", help="draft source: none (plain decoding), retrieval "
                     "(matches in the prompt, the output so far and --corpus, and the verifier's own recycled "
                     "predictions), model:NAME (a small model on this device: smollm2-135m, gemma3-270m or a "
                     ".gguf path; any vocabulary), or hybrid[:NAME] (retrieval and a model in one tree)")
    gen.add_argument("--no-hints", action="store_true", help="do not ask the verifier for its top tokens at "
                     "each verified position (the drafter then drafts from retrieval alone)")
    gen.add_argument("--corpus", action="append", type=Path, default=[], metavar="PATH",
                     help="files or directories for the long-term datastore, or a datastore built with "
                     "`specedge index build` (repeatable); built once and cached")
    gen.add_argument("--max-tree", type=int, default=MAX_TREE_NODES, help="most draft-tree nodes per verification pass")
    gen.add_argument("--max-new-tokens", type=int, default=sampling.max_new_tokens,
                     help="stop after this many generated tokens")
    gen.add_argument("--temperature", type=float, default=sampling.temperature, help="0 = greedy; > 0 samples")
    gen.add_argument("--top-p", type=float, default=sampling.top_p, help="nucleus sampling mass (sampling only)")
    gen.add_argument("--top-k", type=int, default=sampling.top_k,
                     help="keep the k most likely tokens, 0 = all (sampling only)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the output contains TEXT (repeatable); the text is cut before it")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, num_tokens, "
                     "rounds, mean_accepted, tokens_per_s, wall_s")
    gen.add_argument("--server", action="append", default=None, metavar="HOST:PORT",
                     help="verifier to use (repeat the flag for fail-over targets); default: an embedded one")
    gen.add_argument("--auth-token", default=None, help="bearer token for the verifier")
    gen.add_argument("--tls-ca", default=None, help="PEM CA of the verifier: connect with TLS")
    gen.add_argument("--tls-cert", default=None, help="PEM client certificate, for mutual TLS")
    gen.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    gen.add_argument("--kv-pool-mb", type=int, default=ServerConfig.kv_pool_mb,
                     help="KV cache budget of the embedded verifier in MiB")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.edge.client import ChannelConfig, EdgeClient
    from specedge.edge.registry import check_drafter

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"specedge generate: {msg}")

    embedded = None
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))  # reject bad values early
        check_drafter(args.drafter, bool(args.corpus))  # before the slow model load
        if args.max_tree < 0:
            raise ValueError(f"--max-tree must be >= 0, got {args.max_tree}")
        channel = ChannelConfig(auth_token=args.auth_token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                tls_key=args.tls_key)
        tokenizer = None
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
                                        scheduler_thread=False)
            targets = [embedded.target]
        else:
            targets = args.server
        client = EdgeClient(targets, drafter=args.drafter, tokenizer=tokenizer, corpus=args.corpus or None,
                            channel=channel, max_tree=args.max_tree, hints=not args.no_hints)

        def work():
            return client.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                                   chat=args.chat)

        result = embedded.run_engine_while(work) if embedded is not None else work()
    except (ValueError, FileNotFoundError) as e:
        raise fail(str(e).replace("drafter ", "--drafter ", 1))
    except Exception as e:
        import grpc

        if isinstance(e, grpc.RpcError):
            raise fail(f"verifier error {e.code().name}: {e.details()}")
        raise
    finally:
        if embedded is not None:
            embedded.stop()
    stats = result.stats
    if args.json:
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "num_tokens": stats.num_tokens,
            "rounds": stats.rounds, "mean_accepted": round(stats.mean_accepted, 4),
            "tokens_per_s": round(stats.tokens_per_s, 3), "wall_s": round(stats.wall_s, 4),
        }))
    else:
        print(result.text)
        where = ", ".join(args.server) if args.server else "embedded verifier"
        print(
            f"[{args.model} on {where}, drafter {args.drafter}] {stats.num_tokens} tokens in {stats.wall_s:.2f} s = "
            f"{stats.tokens_per_s:.1f} tokens/s, {stats.rounds} passes ({stats.mean_accepted:.2f} tokens/pass), "
            f"stopped by {stats.stopped_by}",
            file=sys.stderr,
        )
    return 0
