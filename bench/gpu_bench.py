"""The engine on a GPU (issue 13): the cost of one pass by tree tokens and by sessions per step, plain
decoding against transformers' `generate`, and greedy agreement with transformers in bfloat16.

Pass cost does not depend on the weights, so the models here are randomly initialised at the real shapes
(the GPU machine cannot receive the real weights); acceptance, which does depend on them, comes from the
CPU benchmarks' recorded runs (bench/gpu_projection.py combines the two).

    python3 bench/gpu_bench.py --out $OUT/gpu.json                       # on the GPU machine
    .venv/bin/python bench/gpu_bench.py --device cpu --shapes smollm2-135m --quick --out /tmp/gpu.json

Every figure is the median of several timed repetitions after warm-up; each step is timed to its result
on the host (a step ends with the verdicts' copy to the CPU, which waits for the GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from specedge.cloud.engine import Engine
from specedge.cloud.greedy_readback import GreedyReadback
from specedge.cloud.hints import top_k_hints
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.padded_attention import pad_groups
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams


def _llama(**shape) -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, **shape)


# The real models' shapes (their configurations, weights aside). llama-1b and llama-8b are Llama 3.2 1B and
# Llama 3.1 8B without their RoPE scaling, which the engine does not support yet (the cost is the same).
SHAPES = {
    "smollm2-135m": lambda: _llama(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   tie_word_embeddings=True, rope_theta=100000.0),
    "gemma3-270m": lambda: Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, max_position_embeddings=32768,
        rope_theta=1e6, rope_local_base_freq=1e4, eos_token_id=1, bos_token_id=2, pad_token_id=0),
    "llama-1b": lambda: _llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                               tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": lambda: _llama(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               tie_word_embeddings=False, rope_theta=500000.0),
    # Not a real model: a pass that costs next to nothing on a CPU, to measure what a verifier's host pays
    # around a fast (GPU) pass (bench/round_split.py --shape tiny); left out of the default sweep.
    "tiny": lambda: _llama(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0),
}
REAL_SHAPES = [name for name in SHAPES if name != "tiny"]
TREE_TOKENS = [0, 1, 3, 7, 15, 31, 63, 127, 255]  # draft nodes; a pass computes one more (the root)
SESSIONS = [1, 2, 4, 8, 16, 32, 64]
TREE_PER_SESSION = [0, 4, 8, 16, 32]
GREEDY = SamplingParams()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_model(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = SHAPES[name]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B model's init on the host takes minutes
        model = (Gemma3ForCausalLM if isinstance(config, Gemma3TextConfig) else LlamaForCausalLM)(config)
    return model.to(dtype).eval()


def random_tree(size: int, vocab: int, rng: random.Random) -> DraftTree:
    """Mostly a chain with branches, as drafts are; random tokens (the pass costs the same)."""
    parents = [i - 1 if rng.random() < 0.7 else rng.randrange(-1, i) for i in range(size)]
    return DraftTree([rng.randrange(vocab) for _ in range(size)], parents)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(engine: Engine, work_of, reps: int, warmup: int = 3) -> float:
    """Median ms of `engine.step(work_of())` over `reps` steps after `warmup` untimed ones."""
    times = []
    for i in range(warmup + reps):
        work = work_of()
        sync(engine.device)
        start = time.perf_counter()
        engine.step(work)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def open_sessions(engine: Engine, count: int, context: int, rng: random.Random, hints: int = 0) -> list:
    seqs = [engine.add_sequence([rng.randrange(3, engine.vocab_size) for _ in range(context)], GREEDY, hints)
            for _ in range(count)]
    for at in range(0, count, 8):  # prefilled a few at a time, as the scheduler's token budget would
        engine.step([(s, DraftTree.empty()) for s in seqs[at : at + 8]])
    return seqs


def pass_cost(engine: Engine, sessions: int, tree: int, context: int, reps: int, rng: random.Random,
              hints: int = 0) -> float:
    """Median ms of a step of `sessions` sessions at `context` tokens, each verifying a tree of `tree` nodes
    (with `hints` hint tokens per row, 0 = none)."""
    seqs = open_sessions(engine, sessions, context, rng, hints)
    ms = timed_steps(engine, lambda: [(s, random_tree(tree, engine.vocab_size, rng)) for s in seqs], reps)
    for s in seqs:
        engine.release(s)
    engine.pool.drop_cached()
    return ms


def engine_decode(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    sync(engine.device)
    start = time.perf_counter()
    seq = engine.add_sequence(prompt, GREEDY)
    while len(seq.output_ids) < new_tokens:
        engine.step([(seq, DraftTree.empty())])
    seconds = time.perf_counter() - start
    out = seq.output_ids[:new_tokens]
    engine.release(seq)
    engine.pool.drop_cached()
    return out, seconds


def hf_decode(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    x = torch.tensor([prompt], device=hf.device)
    sync(hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens)
    sync(hf.device)
    return out[0, len(prompt):].tolist(), time.perf_counter() - start


def step_breakdown(engine: Engine, work_of, reps: int) -> dict:
    """Where a step's time goes: building its batch on the host (and copying it over), the forward pass
    (launches and device time), and the whole step (the verdicts' copy back, hints, commit, bookkeeping)."""
    parts = {"batch_ms": [], "groups_ms": [], "to_ms": [], "build_ms": [], "forward_ms": []}
    for _ in range(reps + 3):
        work = work_of()
        sync(engine.device)
        t0 = time.perf_counter()
        batch, rows = engine._host_batch(work)  # (the KV slots' reservation included)
        t_batch = time.perf_counter()
        pad_groups(batch.seqs)  # timed alone; `to` builds them again, then sends everything over
        t_groups = time.perf_counter()
        batch, rows = batch.to(engine.device, rows)
        sync(engine.device)
        t1 = time.perf_counter()
        engine._forward(batch, engine.pool, rows)  # as a step runs it: replayed from a graph once captured
        sync(engine.device)
        t2 = time.perf_counter()
        for key, ms in (("batch_ms", t_batch - t0), ("groups_ms", t_groups - t_batch), ("to_ms", t1 - t_groups),
                        ("build_ms", t_batch - t0 + t1 - t_groups), ("forward_ms", t2 - t1)):
            parts[key].append(ms * 1e3)
    return {**{key: statistics.median(ms[3:]) for key, ms in parts.items()},
            "step_ms": timed_steps(engine, work_of, reps)}


def sessions_breakdown(engine: Engine, sessions: int, tree: int, context: int, reps: int, rng: random.Random,
                       hints: int = 0) -> dict:
    """`step_breakdown` of a step of `sessions` sessions each verifying a tree of `tree` nodes."""
    seqs = open_sessions(engine, sessions, context, rng, hints)
    row = step_breakdown(engine, lambda: [(s, random_tree(tree, engine.vocab_size, rng)) for s in seqs], reps)
    for s in seqs:
        engine.release(s)
    engine.pool.drop_cached()
    return {"sessions": sessions, "tokens_each": tree + 1, "context": context, "hints": hints, **row}


def hint_ops(device: torch.device, dtype: torch.dtype, rows: int, vocab: int, k: int, reps: int) -> dict:
    """Median ms of each operation of the hints off the CPU (cloud/hints.py top_k_hints_plain) on `rows`
    random rows of logits, and of the whole, to see which one a step of many sessions with hints pays for;
    then what a greedy step reads back, argmax and hints: as three copies (`separate`, the engine before
    cloud/greedy_readback.py), packed into one (`readback`), and that compiled (`readback_compiled`)."""
    logits = torch.randn(rows, vocab, device=device, dtype=dtype) * 4
    eager, compiled = GreedyReadback(), GreedyReadback(compiled=True)
    ops = {
        "float": lambda: logits.float(),
        "topk_fp32": lambda: logits.float().topk(k, dim=-1),
        "topk_native": lambda: logits.topk(k, dim=-1),
        "logsumexp": lambda: torch.logsumexp(logits.float() - logits.float().amax(-1, keepdim=True), dim=-1),
        "whole": lambda: top_k_hints(logits, k),
        "separate": lambda: (logits.argmax(-1).cpu(), top_k_hints(logits, k)),
        "readback": lambda: eager(logits, k).hints(0, rows, k),
        "readback_compiled": lambda: compiled(logits, k).hints(0, rows, k),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(reps + 3):
            sync(device)
            start = time.perf_counter()
            op()
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(times[3:])
    return {"rows": rows, "vocab": vocab, "k": k, **out}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_shape(name: str, device: torch.device, dtype: torch.dtype, args) -> dict:
    rng = random.Random(0)
    hf = random_model(name, device, dtype)
    most = max(args.sessions + args.breakdown_sessions)
    runner_tokens = most * (args.contexts[0] + 3 * args.reps + 64) + 2 * (max(args.contexts) + 512)
    per_token = KVBlockPool.block_bytes(1, hf.config.num_hidden_layers, hf.config.num_key_value_heads,
                                        hf.config.head_dim, dtype)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=runner_tokens * per_token, device=device, dtype=dtype,
                                  compile_layers=args.compile)  # compiled at the first steps (warmup_s below)
    result = {"shape": name, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
              "params_m": round(sum(p.numel() for p in hf.parameters()) / 1e6, 1), "compiled": engine.compiled}

    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(128)]
    graphs = engine.graphs
    start = time.perf_counter()
    engine_decode(engine, prompt, 8), hf_decode(hf, prompt, 8)  # warm-up (kernels, allocator, compiling)
    result["warmup_s"] = time.perf_counter() - start
    runs = {"engine_eager": [], "engine": [], "hf": []}
    for _ in range(args.decode_reps):  # interleaved
        if graphs:
            graphs.enabled = False
            _, t_eager = engine_decode(engine, prompt, args.new_tokens)
            runs["engine_eager"].append(args.new_tokens / t_eager)
            graphs.enabled = True
        ours, t_ours = engine_decode(engine, prompt, args.new_tokens)
        theirs, t_hf = hf_decode(hf, prompt, args.new_tokens)
        runs["engine"].append(args.new_tokens / t_ours)
        runs["hf"].append(args.new_tokens / t_hf)
    result["decode"] = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "runs": runs,
                        "agree_first_tokens": first_difference(ours, theirs),
                        **{f"{k}_tok_s": statistics.median(v) for k, v in runs.items() if v}}
    result["decode"]["ratio"] = result["decode"]["engine_tok_s"] / result["decode"]["hf_tok_s"]
    log(f"{name}: plain decoding {result['decode']['engine_tok_s']:.0f} tok/s (eager "
        f"{result['decode'].get('engine_eager_tok_s', 0):.0f}), transformers {result['decode']['hf_tok_s']:.0f} "
        f"tok/s ({result['decode']['ratio']:.2f}x); same first {result['decode']['agree_first_tokens']} tokens")

    seq = engine.add_sequence(prompt, GREEDY)
    engine.step([(seq, DraftTree.empty())])
    result["decode_step"] = step_breakdown(engine, lambda: [(seq, DraftTree.empty())], args.reps)
    engine.release(seq)
    engine.pool.drop_cached()
    log(f"{name}: a decoding step: {result['decode_step']}")

    result["by_tree_tokens"], result["by_sessions"] = [], []
    for hints in sorted({0, args.hints}):
        for context in args.contexts:
            rows = [{"context": context, "tokens": tree + 1, "hints": hints,
                     "ms": pass_cost(engine, 1, tree, context, args.reps, rng, hints)} for tree in TREE_TOKENS]
            result["by_tree_tokens"] += rows
            log(f"{name}: one session at context {context}, hints {hints}, pass ms by tokens: "
                + " ".join(f"{r['tokens']}:{r['ms']:.2f}" for r in rows))
        for sessions in args.sessions:
            rows = [{"context": args.contexts[0], "sessions": sessions, "tokens_each": tree + 1, "hints": hints,
                     "ms": pass_cost(engine, sessions, tree, args.contexts[0], args.reps, rng, hints)}
                    for tree in TREE_PER_SESSION]
            result["by_sessions"] += rows
            log(f"{name}: {sessions} sessions, hints {hints}, pass ms by tokens each: "
                + " ".join(f"{r['tokens_each']}:{r['ms']:.2f}" for r in rows))
    result["breakdowns"] = [sessions_breakdown(engine, n, tree, args.contexts[0], args.reps, rng, hints)
                            for n in args.breakdown_sessions for tree in (0, 8) for hints in sorted({0, args.hints})]
    for row in result["breakdowns"]:
        log(f"{name}: breakdown {row}")
    if args.hints:
        result["hint_ops"] = [hint_ops(device, dtype, rows, engine.vocab_size, args.hints, args.reps)
                              for rows in (9, 144)]
        log(f"{name}: hint operations (ms): {result['hint_ops']}")
    result["graphs_captured"] = len(engine.graphs.graphs) if engine.graphs else 0
    result["graphs_enabled"] = bool(engine.graphs and engine.graphs.enabled)
    del engine, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(REAL_SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--contexts", default="512,2048", help="tokens of context per session (the first: for the "
                   "sessions sweep)")
    p.add_argument("--sessions", default=",".join(map(str, SESSIONS)), help="sessions per step to sweep")
    p.add_argument("--hints", type=int, default=0, help="also measure with this many hint tokens per row")
    p.add_argument("--breakdown-sessions", default="1,16", help="steps of this many sessions are split into "
                   "host, forward and whole-step time")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--decode-reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="torch.compile each layer's dense parts")
    p.add_argument("--quick", action="store_true", help="a smoke run: few sessions, short contexts")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.breakdown_sessions = [int(n) for n in args.breakdown_sessions.split(",")]
    if args.quick:
        global TREE_TOKENS, TREE_PER_SESSION
        TREE_TOKENS, TREE_PER_SESSION = [0, 7], [0, 4]
        args.contexts, args.sessions, args.reps, args.decode_reps, args.new_tokens = [64], [1, 2], 2, 1, 8
        args.breakdown_sessions = [2]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    info = {"torch": torch.__version__}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    results = {"info": info, "shapes": []}
    for name in args.shapes.split(","):
        results["shapes"].append(measure_shape(name, device, dtype, args))
        args.out.write_text(json.dumps(results, indent=1))  # what is measured so far survives a time-out
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
