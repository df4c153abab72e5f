"""What verifier hints cost (issue 11): the extra time of a verification pass that also computes the
target's top k at every position, and the extra bytes of its verdict.

    .venv/bin/python bench/hints_cost.py --models smollm2-135m gemma3-270m --threads 1 --out bench-out/hints-cost

Two sequences with the same ~400-token context, one asking for hints and one not, take turns through real
engine steps with the same random draft chains (nothing accepted, one token committed a step); medians
of the step time per tree size, side by side in one run. That difference is within the noise of a pass
on this machine (a few %), so the hints' own work is also timed alone, on the logits of those passes
(`hint ms`, its share of the plain pass). Bytes: the serialised Hints message and the Verdict without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specedge.bench import specbench
from specedge.cloud.engine import Engine
from specedge.cloud.hints import top_k_hints
from specedge.cloud.model_registry import load_model
from specedge.common import wire
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import DEFAULT_HINTS_TOP_K
from specedge.common.params import SamplingParams
from specedge.protos import verifier_pb2 as pb

TREE_TOKENS = [0, 4, 16, 64]


def measure(engine: Engine, context: list[int], k: int, reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    plain = engine.add_sequence(context, SamplingParams())
    hinted = engine.add_sequence(context, SamplingParams(), hints_top_k=k)
    engine.step([(plain, DraftTree.empty())])
    engine.step([(hinted, DraftTree.empty())])
    rows = []
    for n in TREE_TOKENS:
        times: dict[str, list[float]] = {"plain": [], "hints": [], "alone": []}
        size = {}
        for rep in range(reps + 1):
            tree = DraftTree.chain(torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist())
            order = [("plain", plain), ("hints", hinted)][:: 1 if rep % 2 else -1]  # alternate who goes first
            for name, seq in order:
                start = time.perf_counter()
                (verdict,) = engine.step([(seq, tree)])
                if rep:  # the first of each size warms up its allocations
                    times[name].append((time.perf_counter() - start) * 1e3)
                msg = pb.Verdict(tokens=verdict.tokens, accepted=verdict.accepted, compute_ms=1.0)
                if verdict.hints is not None:
                    size["hints"] = len(wire.hints_to_pb(verdict.hints).SerializeToString())
            (logits,) = engine.forward([(plain, tree)])  # the same rows a pass with hints works on
            engine.pool.truncate(plain.seq_id, plain.num_cached)
            start = time.perf_counter()
            top_k_hints(logits, k)
            if rep:
                times["alone"].append((time.perf_counter() - start) * 1e3)
                size[name + "_verdict"] = len(msg.SerializeToString())
        plain_ms, hints_ms = statistics.median(times["plain"]), statistics.median(times["hints"])
        alone_ms = statistics.median(times["alone"])
        rows.append({"tree_tokens": n, "plain_ms": plain_ms, "hints_ms": hints_ms, "hint_alone_ms": alone_ms,
                     "hint_share": alone_ms / plain_ms,
                     "extra_ms": hints_ms - plain_ms, "extra_share": hints_ms / plain_ms - 1,
                     "hint_bytes": size["hints"], "verdict_bytes": size["plain_verdict"]})
        print(f"  {n:3d} nodes: {plain_ms:.1f} ms -> {hints_ms:.1f} ms with hints ({rows[-1]['extra_share']:+.1%}); "
              f"hints alone {alone_ms:.2f} ms ({alone_ms / plain_ms:.1%}); +{size['hints']} bytes",
              file=sys.stderr, flush=True)
    engine.release(plain)
    engine.release(hinted)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--k", type=int, default=DEFAULT_HINTS_TOP_K, help="hint tokens per position")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("bench-out/hints-cost"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    long_text = " ".join(p.text for p in specbench.load(categories=["summarization"])[:3])
    results = {"threads": torch.get_num_threads(), "k": args.k, "models": {}}
    for name in args.models:
        hf, tokenizer = load_model(name)
        engine = Engine.from_hf_model(hf, kv_pool_bytes=256 << 20)
        print(f"{name} (V = {engine.vocab_size}), {torch.get_num_threads()} thread(s)", file=sys.stderr)
        context = tokenizer(long_text)["input_ids"][: args.context]
        results["models"][name] = measure(engine, context, args.k, args.reps)
        del engine, hf
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"{results['threads']} thread(s), k = {args.k}, medians of {args.reps} interleaved steps", "",
             "| model | draft nodes | pass ms | with hints | difference | hint ms alone | share of the pass | "
             "hint bytes | verdict bytes without |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in results["models"].items():
        for r in rows:
            lines.append(f"| {name} | {r['tree_tokens']} | {r['plain_ms']:.1f} | {r['hints_ms']:.1f} | "
                         f"{r['extra_share']:+.1%} | {r['hint_alone_ms']:.2f} | {r['hint_share']:.1%} | "
                         f"{r['hint_bytes']} | {r['verdict_bytes']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
