"""Engine benchmarks (issue 2): plain decoding vs transformers `generate`, the cost of one verification
pass by its number of tokens, and the oracle-draft speedup ceiling.

    .venv/bin/python bench/engine_bench.py --models smollm2-135m gemma3-270m --out bench-out/engine

Everything is measured side by side in one run, interleaved, several repetitions, medians.
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
from specedge.bench.oracle import OracleDrafter
from specedge.cloud.engine import Engine
from specedge.cloud.local import LocalVerifier
from specedge.cloud.model_registry import load_model
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.generation import generate
from specedge.edge.tokenizer import EdgeTokenizer

TREE_TOKENS = [0, 1, 2, 4, 8, 16, 32, 64, 128]  # 0: a plain decoding step
ORACLE_DEPTHS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hf_generate(hf, ids: list[int], new_tokens: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens)
    return out[0, len(ids) :].tolist()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def plain_decoding(hf, engine: Engine, prompts: list[list[int]], new_tokens: int, reps: int) -> dict:
    """tokens/s of the engine (no drafts) and of transformers' generate, interleaved per prompt."""
    params = SamplingParams(max_new_tokens=new_tokens)
    engine_s, hf_s, mismatches = [], [], 0
    for rep in range(reps):
        for i, ids in enumerate(prompts):
            ours, t_ours = timed(lambda: generate(LocalVerifier(engine).open(ids, params)))
            theirs, t_hf = timed(lambda: hf_generate(hf, ids, new_tokens))
            mismatches += ours.token_ids != theirs
            engine_s.append(new_tokens / t_ours)
            hf_s.append(new_tokens / t_hf)
            log(f"  plain rep {rep} prompt {i}: engine {engine_s[-1]:.1f} tok/s, transformers {hf_s[-1]:.1f} tok/s")
    e, h = statistics.median(engine_s), statistics.median(hf_s)
    return {"engine_tokens_per_s": e, "hf_tokens_per_s": h, "ratio": e / h, "greedy_mismatches": mismatches,
            "runs": len(engine_s)}


def verify_cost(engine: Engine, context: list[int], reps: int, sizes: list[int] = TREE_TOKENS) -> list[dict]:
    """Milliseconds of one pass over a chain of n draft tokens after `context`, per n: the pass with every row's
    logits (what sampling needs) and the greedy step (pass, argmax, verdict, commit: the int8 argmax of
    cloud/int8_argmax.py where it applies), interleaved. The drafts are slices of the context, real text as
    retrieval drafts it: random tokens would give rows flat distributions, which the int8 argmax leaves to float32
    logits after its own read, so the greedy step would cost more than real drafts' do."""
    seq = engine.add_sequence(context, SamplingParams())
    engine.step([(seq, DraftTree.empty())])  # prefill
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        logits_ms, greedy_ms = [], []
        for _ in range(reps + 1):
            start = int(torch.randint(0, max(1, len(context) - n), (1,), generator=gen))
            tree = DraftTree.chain((context * (1 + n // len(context)))[start : start + n])
            _, t = timed(lambda: engine.forward([(seq, tree)]))
            engine.pool.truncate(seq.seq_id, len(seq.token_ids))  # nothing committed: drop the draft's slots
            logits_ms.append(t * 1e3)
            _, t = timed(lambda: engine.step([(seq, tree)]))  # commits a token or so: the context barely grows
            greedy_ms.append(t * 1e3)
        # the first run warms up allocations for this size
        ms, greedy = statistics.median(logits_ms[1:]), statistics.median(greedy_ms[1:])
        rows.append({"tree_tokens": n, "ms": ms, "greedy_ms": greedy})
        log(f"  verify {n:4d} tokens: {ms:.1f} ms with logits, {greedy:.1f} ms greedy step")
    engine.release(seq)
    base = rows[0]["ms"]
    for r in rows:
        r["relative"] = r["ms"] / base
    return rows


def oracle_curve(engine: Engine, prompts: list[list[int]], new_tokens: int, reps: int) -> list[dict]:
    """Speedup over plain decoding when every draft is the true continuation, by draft depth."""
    params = SamplingParams(max_new_tokens=new_tokens)
    references = [generate(LocalVerifier(engine).open(ids, params)).token_ids for ids in prompts]
    speedups: dict[int, list[float]] = {d: [] for d in ORACLE_DEPTHS}
    accepted: dict[int, list[float]] = {d: [] for d in ORACLE_DEPTHS}
    for rep in range(reps):
        for ids, ref in zip(prompts, references):
            plain, t_plain = timed(lambda: generate(LocalVerifier(engine).open(ids, params)))
            for d in ORACLE_DEPTHS:
                spec, t_spec = timed(lambda: generate(LocalVerifier(engine).open(ids, params),
                                                      drafter=OracleDrafter(ids + ref, d)))
                assert spec.token_ids == ref == plain.token_ids, "oracle drafts changed the greedy output"
                speedups[d].append(t_plain / t_spec)
                accepted[d].append(spec.mean_accepted)
        log(f"  oracle rep {rep}: " + ", ".join(f"d{d} {statistics.median(speedups[d]):.2f}x" for d in ORACLE_DEPTHS))
    return [{"depth": d, "speedup": statistics.median(speedups[d]),
             "mean_accepted": statistics.median(accepted[d])} for d in ORACLE_DEPTHS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"], help="registry names")
    ap.add_argument("--prompts", type=int, default=6, help="Spec-Bench prompts, stratified over categories")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--context", type=int, default=400, help="context tokens before the verified tree")
    ap.add_argument("--parts", default="plain,cost,oracle", help="which of plain,cost,oracle to run")
    ap.add_argument("--tree-tokens", default=",".join(map(str, TREE_TOKENS)),
                    help="the cost part's draft sizes (its greedy steps price a replay's passes: bench/replay.py "
                         "--cost cpu:FILE:MODEL)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/engine"), help="output directory")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tree_tokens = [int(n) for n in args.tree_tokens.split(",")]
    results = {"torch_threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
               "models": {}}
    for name in args.models:
        log(f"{name}: loading")
        hf, tokenizer = load_model(name)
        engine = Engine.from_hf_model(hf, kv_pool_bytes=512 << 20)
        chat = bool(getattr(tokenizer, "chat_template", None))
        chosen = specbench.stratified(specbench.load(), args.prompts)
        edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
        prompts = [edge_tokenizer.encode_prompt(p.text, chat=chat) for p in chosen]
        long_text = " ".join(p.text for p in specbench.load(categories=["summarization"])[:3])
        context = tokenizer(long_text)["input_ids"][: args.context]
        parts = args.parts.split(",")
        log(f"{name}: plain decoding, engine vs transformers")
        plain = plain_decoding(hf, engine, prompts, args.new_tokens, args.reps) if "plain" in parts else None
        log(f"{name}: verification cost by tree size")
        cost = verify_cost(engine, context, max(args.reps, 5), tree_tokens) if "cost" in parts else []
        log(f"{name}: oracle drafts")
        oracle = oracle_curve(engine, prompts, args.new_tokens, args.reps) if "oracle" in parts else []
        results["models"][name] = {"plain": plain, "verify_cost": cost, "oracle": oracle,
                                   "prompt_tokens": [len(p) for p in prompts]}
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        del engine, hf
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = []
    for name, r in results["models"].items():
        lines += [f"### {name}", ""]
        if p := r["plain"]:
            lines += [f"Plain decoding: engine {p['engine_tokens_per_s']:.1f} tokens/s, transformers generate "
                      f"{p['hf_tokens_per_s']:.1f} tokens/s, ratio **{p['ratio']:.2f}** (median of {p['runs']} "
                      f"runs; {p['greedy_mismatches']} greedy mismatches)", ""]
        if c := r["verify_cost"]:
            lines += ["| tree tokens | " + " | ".join(str(x["tree_tokens"]) for x in c) + " |",
                      "|---|" + "---|" * len(c),
                      "| ms per pass, logits | " + " | ".join(f"{x['ms']:.0f}" for x in c) + " |",
                      "| ms per greedy step | " + " | ".join(f"{x['greedy_ms']:.0f}" for x in c) + " |",
                      f"| vs {c[0]['tree_tokens']} tokens | " + " | ".join(f"{x['relative']:.2f}" for x in c) + " |", ""]
        if o := r["oracle"]:
            lines += ["| oracle depth | " + " | ".join(str(x["depth"]) for x in o) + " |",
                      "|---|" + "---|" * len(o),
                      "| tokens per pass | " + " | ".join(f"{x['mean_accepted']:.2f}" for x in o) + " |",
                      "| speedup | " + " | ".join(f"{x['speedup']:.2f}x" for x in o) + " |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
