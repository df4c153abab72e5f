"""Where a one-session pass's extra time over a one-token pass goes (issue 13, BENCHMARKS.md section 9):
the device time of each kind of kernel in an eager forward pass of 1 token and of a tree of n tokens, by
torch.profiler, side by side, largest growth first.

    python3 bench/gpu_profile.py --shapes smollm2-135m,llama-8b --out $OUT/profile.json     # GPU machine
    .venv/bin/python bench/gpu_profile.py --device cpu --shapes smollm2-135m --tokens 8 --out /tmp/p.json

Eager (no CUDA graph), so that each kernel is seen; a graph replays the same kernels without the launches.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specedge.bench.gpu_bench import log, open_sessions, random_model, random_tree, sync
from specedge.cloud.engine import Engine
from specedge.cloud.kv_pool import KVBlockPool
from specedge.common.draft_tree import DraftTree


def kernel_ms(engine: Engine, work_of, reps: int) -> tuple[dict[str, float], dict[str, str]]:
    """Device ms per pass of each kernel, keyed by the kernel and the operators that launched it (on the CPU:
    each top-level operator's time), summed over its calls in one pass; and the launching operator's first
    inputs' shapes by the same key."""
    for _ in range(3):
        engine.forward(work_of())
    sync(engine.device)
    on_gpu = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(record_shapes=True, activities=activities) as prof:
        for _ in range(reps):
            engine.forward(work_of())
        sync(engine.device)
    totals: dict[str, float] = {}
    shapes: dict[str, str] = {}
    for event in prof.events():  # each kernel under the operator that launched it and that operator's callers
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, parent = [event.name], event.cpu_parent
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parent.cpu_parent
        where = " < ".join(chain)
        spans = [(k.name, k.duration) for k in event.kernels] if on_gpu else (
            [] if event.cpu_parent is not None else [("", event.time_range.elapsed_us())])
        for kernel, us in spans:
            name = f"{where} :: {kernel[:60]}"
            totals[name] = totals.get(name, 0.0) + us / 1e3 / reps
            shapes[name] = str(event.input_shapes[:2])
    return totals, shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,llama-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32, help="tokens of the tree pass (its nodes + 1)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = []
    for name in args.shapes.split(","):
        hf = random_model(name, device, dtype)
        per_token = KVBlockPool.block_bytes(1, hf.config.num_hidden_layers, hf.config.num_key_value_heads,
                                            hf.config.head_dim, dtype)
        engine = Engine.from_hf_model(hf, kv_pool_bytes=4 * (args.context + 512) * per_token, device=device,
                                      dtype=dtype)
        if engine.graphs:
            engine.graphs.enabled = False
        rng = random.Random(0)
        (seq,) = open_sessions(engine, 1, args.context, rng)
        one, one_shapes = kernel_ms(engine, lambda: [(seq, DraftTree.empty())], args.reps)
        vocab = engine.vocab_size
        tree, tree_shapes = kernel_ms(engine, lambda: [(seq, random_tree(args.tokens - 1, vocab, rng))], args.reps)
        rows = sorted(({"kernel": k, "one_ms": one.get(k, 0.0), "tree_ms": tree.get(k, 0.0),
                       "shapes": [one_shapes.get(k), tree_shapes.get(k)]} for k in one | tree),
                      key=lambda r: r["tree_ms"] - r["one_ms"], reverse=True)
        total_one, total_tree = sum(one.values()), sum(tree.values())
        log(f"{name}: device time per pass, 1 token {total_one:.3f} ms, {args.tokens} tokens {total_tree:.3f} ms")
        for r in rows[: args.top]:
            log(f"  {r['tree_ms'] - r['one_ms']:+7.3f}  {r['one_ms']:7.3f} -> {r['tree_ms']:7.3f}  {r['kernel']}  "
                f"{r['shapes'][1]}")
        results.append({"shape": name, "tokens": args.tokens, "context": args.context, "one_ms": total_one,
                        "tree_ms": total_tree, "kernels": rows})
        del engine, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"torch": torch.__version__, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
