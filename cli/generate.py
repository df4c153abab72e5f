"""`specedge generate PROMPT`: one generation, against a verifier given by --server or one started on
loopback in this process."""

from __future__ import annotations

import argparse
import json
import sys

from specedge.cli.edge_flags import add_edge_flags, edge_client
from specedge.cli.prefill_progress import PrefillProgress
from specedge.common.params import SamplingParams
from specedge.edge.text_stream import tokens_of


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
    add_edge_flags(gen, default_drafter="none")
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
                     "generated_tokens, rounds, mean_accepted, tokens_per_s, wall_s. With --stop, text ends before "
                     "the stop string and token_ids/num_tokens are the tokens whose text lies wholly within it; "
                     "generated_tokens counts all the verifier produced (what tokens_per_s counts). Like "
                     "transformers' decode, text ends in U+FFFD when --max-new-tokens cuts a character short")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    def fail(msg: str) -> SystemExit:
        return SystemExit(f"specedge generate: {msg}")

    embedded = None
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                       max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))  # reject bad values early
        client, embedded = edge_client(args, engine_thread=False)
        prefill = PrefillProgress()

        def work():
            return client.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                                   chat=args.chat, on_prefill=prefill)

        try:
            result = embedded.run_engine_while(work) if embedded is not None else work()
        finally:
            prefill.done()
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
        ids = tokens_of(client.tokenizer, result.token_ids, result.text) if stats.stopped_by == "stop" \
            else result.token_ids
        print(json.dumps({
            "text": result.text, "token_ids": ids, "num_tokens": len(ids), "generated_tokens": stats.num_tokens,
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
