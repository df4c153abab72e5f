"""Attention over the paged KV pool on the CPU: the project's AVX2 kernel (cloud/avx2_attention.py) against torch's
batched products (cloud/attention.py's `grouped_attention` over the pool's strided view, what runs without the
kernel), for a pass's shapes: every layer of a model once, as a pass reads them (the pool far larger than the
caches), by query rows and context length. Random values in the real models' shapes; ms per pass, medians.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/attention_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specedge.cloud import avx2_attention
from specedge.cloud.attention import grouped_attention

SHAPES = {  # layers, query heads, kv heads, head dim
    "smollm2-135m": (30, 9, 3, 64),
    "gemma3-270m": (18, 4, 1, 256),
}


def one_pass(fn, layers: int, q, k_pool, v_pool, ctx: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in range(layers):
        fn(q, k_pool[layer], v_pool[layer], ctx)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,9,17", help="query rows (tokens) per pass")
    ap.add_argument("--contexts", default="400,900", help="context lengths")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not avx2_attention.available():
        raise SystemExit("the AVX2 attention kernel is not available here")
    print(f"torch threads {torch.get_num_threads()}; ms per pass over every layer, median of {args.reps}\n")
    print("| model | context | rows | torch's products | kernel | ratio |\n|---|---|---|---|---|---|")
    for name, (layers, heads, kv_heads, head_dim) in SHAPES.items():
        slots = 4096
        gen = torch.Generator().manual_seed(0)
        k_pool = torch.randn(layers, slots, kv_heads, head_dim, generator=gen)
        v_pool = torch.randn(layers, slots, kv_heads, head_dim, generator=gen)
        scale = head_dim**-0.5
        for ctx_len in map(int, args.contexts.split(",")):
            ctx = torch.arange(100, 100 + ctx_len)  # consecutive slots: torch's path gets a view, no gather
            for rows in map(int, args.rows.split(",")):
                q = torch.randn(rows, heads, head_dim, generator=gen)
                mask = torch.ones(rows, ctx_len, dtype=torch.bool)
                mask[:, -rows:] = torch.ones(rows, rows, dtype=torch.bool).tril()  # a chain after the context
                bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).repeat(heads // kv_heads, 1)
                visible = mask.to(torch.uint8)

                def by_torch(q, k, v, c):
                    first, last = int(c[0]), int(c[-1]) + 1
                    return grouped_attention(q, k[first:last].transpose(0, 1), v[first:last].transpose(0, 1), bias,
                                             scale)

                def by_kernel(q, k, v, c):
                    return avx2_attention.attention(q, k, v, c, visible, scale)

                times = {"torch": [], "kernel": []}
                for _ in range(args.reps + 1):  # the first is a warm-up
                    times["torch"].append(one_pass(by_torch, layers, q, k_pool, v_pool, ctx))
                    times["kernel"].append(one_pass(by_kernel, layers, q, k_pool, v_pool, ctx))
                t, k = (statistics.median(times[m][1:]) for m in ("torch", "kernel"))
                print(f"| {name} | {ctx_len} | {rows} | {t:.2f} | {k:.2f} | {t / k:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
