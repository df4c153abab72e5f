"""specedge: edge-cloud speculative decoding. `specedge --help` lists the commands."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MODEL = "smollm2-135m"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specedge",
        description="Edge-cloud speculative decoding: edge clients draft, verifiers check drafts losslessly.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    gen.add_argument("--drafter", default="none", help="draft source: none (plain decoding); retrieval, "
                     "model:NAME and hybrid arrive with their issues")
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
    gen.set_defaults(run=run_generate)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from specedge.cloud.engine import Engine
    from specedge.cloud.generation import generate
    from specedge.common.model_registry import load_model
    from specedge.common.sampling import SamplingParams
    from specedge.common.text import encode_prompt, eos_token_ids, stop_at_strings

    if args.drafter != "none":
        raise SystemExit(f"specedge generate: --drafter {args.drafter!r} is not available yet (only 'none')")
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
        )
    except ValueError as e:
        raise SystemExit(f"specedge generate: {e}")
    try:
        hf_model, tokenizer = load_model(args.model)
    except ValueError as e:
        raise SystemExit(f"specedge generate: {e}")
    engine = Engine.from_hf_model(hf_model, kv_pool_bytes=args.kv_pool_mb << 20)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    stop = stop_at_strings(tokenizer, params.stop) if params.stop else None
    result = generate(engine, prompt_ids, params, eos_token_ids(hf_model), stop=stop)
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
            f"[{args.model}] {result.num_tokens} tokens in {result.wall_s:.2f} s = {result.tokens_per_s:.1f} tokens/s, "
            f"{result.rounds} passes ({result.mean_accepted:.2f} tokens/pass), stopped by {result.stopped_by}",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
