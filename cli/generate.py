"""`specedge generate PROMPT`: one generation on an in-process verifier engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt on an in-process verifier engine. Greedy output equals "
        "transformers' generate token for token; sampled output follows the model's distribution.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="registry name (smollm2-135m, gemma3-270m) or a local "
                     "Hugging Face model directory")
    gen.add_argument("--drafter", default="none", help="draft source: none (plain decoding) or retrieval "
                     "(matches in the prompt, the output so far and --corpus); model:NAME and hybrid come later")
    gen.add_argument("--corpus", action="append", type=Path, default=[], metavar="PATH",
                     help="files or directories for the long-term datastore, or a datastore built with "
                     "`specedge index build` (repeatable); built once and cached")
    gen.add_argument("--max-tree", type=int, default=64, help="most draft-tree nodes per verification pass")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many generated tokens")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (sampling only)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all (sampling only)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the output contains TEXT (repeatable); the text is cut before it")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, num_tokens, "
                     "rounds, mean_accepted, tokens_per_s, wall_s")
    gen.add_argument("--kv-pool-mb", type=int, default=256, help="KV cache budget of the engine in MiB")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.engine import Engine
    from specedge.cloud.local import LocalVerifier
    from specedge.common.model_registry import load_model
    from specedge.common.sampling import SamplingParams
    from specedge.common.text import encode_prompt, eos_token_ids, stop_at_strings
    from specedge.edge.controller import TreeSizeController
    from specedge.edge.corpus import open_corpus
    from specedge.edge.generation import generate
    from specedge.edge.registry import make_drafter

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"specedge generate: {msg}")

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
        )
        make_drafter(args.drafter)  # reject a bad --drafter before the slow model load
        if args.max_tree < 0:
            raise ValueError(f"--max-tree must be >= 0, got {args.max_tree}")
        hf_model, tokenizer = load_model(args.model)
        store = open_corpus(args.corpus, tokenizer) if args.corpus else None
        drafter = make_drafter(args.drafter, store, max_nodes=args.max_tree)
    except (ValueError, FileNotFoundError) as e:
        raise fail(str(e).replace("drafter ", "--drafter ", 1))
    engine = Engine.from_hf_model(hf_model, kv_pool_bytes=args.kv_pool_mb << 20)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    stop = stop_at_strings(tokenizer, params.stop) if params.stop else None
    session = LocalVerifier(engine).open(prompt_ids, params)
    result = generate(session, eos_token_ids(hf_model), drafter, TreeSizeController(args.max_tree), stop)
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    for s in params.stop:
        text = text.split(s)[0]
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": result.token_ids, "num_tokens": result.num_tokens,
            "rounds": result.rounds, "mean_accepted": round(result.mean_accepted, 4),
            "tokens_per_s": round(result.tokens_per_s, 3), "wall_s": round(result.wall_s, 4),
        }))
    else:
        print(text)
        print(
            f"[{args.model}, drafter {args.drafter}] {result.num_tokens} tokens in {result.wall_s:.2f} s = "
            f"{result.tokens_per_s:.1f} tokens/s, {result.rounds} passes ({result.mean_accepted:.2f} tokens/pass), "
            f"stopped by {result.stopped_by}",
            file=sys.stderr,
        )
    return 0
