"""Attention over the paged KV pool on the CPU: the project's AVX2 kernel (cloud/avx2_attention.py) against torch's
batched products (cloud/attention.py's `grouped_attention` over the pool's strided view, what runs without the
kernel), for a pass's shapes: every layer of a model once, as a pass reads them (the pool far larger than the
caches), by query rows and context length. Random values in the real models' shapes; ms per pass, medians.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/attention_bench.py
    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/attention_bench.py --slots scattered --against HEAD~1

`--slots scattered`: a context of whole 16-slot blocks in random order, as a long-lived pool hands them out
(torch's path then gathers them first, as cloud/attention.py does); `consecutive` (the default) gives it a view.
`--against COMMIT`: that commit's kernel (its cloud/avx2_attention.cpp, built as this one is) timed beside this
tree's, passes interleaved, and whether both give the same bits: a machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from specedge.bench.kernel_at import kernel_at
from specedge.cloud import avx2_attention
from specedge.cloud.attention import grouped_attention

SHAPES = {  # layers, query heads, kv heads, head dim
    "smollm2-135m": (30, 9, 3, 64),
    "gemma3-270m": (18, 4, 1, 256),
}
BLOCK = 16  # the pool's block size


def one_pass(fn, layers: int, q, k_pool, v_pool, ctx: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in range(layers):
        fn(q, k_pool[layer], v_pool[layer], ctx)
    return (time.perf_counter() - start) * 1e3


def attention_at(commit: str) -> ctypes.CDLL:
    """The attention kernel as of `commit`, its functions declared as this tree's."""
    library = kernel_at(commit, "avx2_attention.cpp")
    if hasattr(library, "avx2_paged_attention"):
        avx2_attention._declare(library)
        return library
    return _Before(library)


class _Before:
    """A kernel from before causal chains and AVX-512 (its entry point `avx2_attention`, without either argument),
    called as this tree's is."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, n = ctypes.c_void_p, ctypes.c_long
        library.avx2_attention.argtypes = [p, n, n, n, n, p, p, n, p, n, p, ctypes.c_float, p, ctypes.c_int]
        library.avx2_attention.restype = None
        self.library = library

    def avx2_paged_attention(self, *args) -> None:
        *head, causal, scale, out, threads, _isa = args
        if causal:
            raise ValueError("that commit's kernel has no causal chains")
        self.library.avx2_attention(*head, scale, out, threads)

    def avx2_attention_isa(self) -> int:
        return 1


def through(library: ctypes.CDLL | None):
    """avx2_attention.attention on `library` (None: this tree's)."""
    own = avx2_attention._kernel.library

    def attention(*args):
        avx2_attention._kernel.library = library or own  # the module's call, another build of the kernel under it
        try:
            return avx2_attention.attention(*args)
        finally:
            avx2_attention._kernel.library = own
    return attention


def context_slots(length: int, pool_slots: int, scattered: bool, gen: torch.Generator) -> torch.Tensor:
    if not scattered:
        return torch.arange(100, 100 + length)
    blocks = torch.randperm(pool_slots // BLOCK, generator=gen)[: -(-length // BLOCK)]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:length].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,9,17", help="query rows (tokens) per pass")
    ap.add_argument("--contexts", default="400,900", help="context lengths")
    ap.add_argument("--slots", choices=["consecutive", "scattered"], default="consecutive",
                    help="the context's pool slots: one run, or 16-slot blocks in random order")
    ap.add_argument("--against", metavar="COMMIT", help="also time that commit's kernel, passes interleaved")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not avx2_attention.available():
        raise SystemExit("the AVX2 attention kernel is not available here")
    kernels = {"kernel": through(None)}
    if args.against:
        kernels[f"kernel@{args.against}"] = through(attention_at(args.against))
    print(f"torch threads {torch.get_num_threads()}; {args.slots} slots; ms per pass over every layer, median of "
          f"{args.reps}\n")
    extra = f" kernel@{args.against} | this / that | same bits |" if args.against else ""
    print(f"| model | context | rows | torch's products | kernel | ratio |{extra}\n"
          f"|---|---|---|---|---|---|{'---|---|---|' if args.against else ''}")
    for name, (layers, heads, kv_heads, head_dim) in SHAPES.items():
        pool_slots = 8192
        gen = torch.Generator().manual_seed(0)
        k_pool = torch.randn(layers, pool_slots, kv_heads, head_dim, generator=gen)
        v_pool = torch.randn(layers, pool_slots, kv_heads, head_dim, generator=gen)
        scale = head_dim**-0.5
        for ctx_len in map(int, args.contexts.split(",")):
            ctx = context_slots(ctx_len, pool_slots, args.slots == "scattered", gen)
            for rows in map(int, args.rows.split(",")):
                q = torch.randn(rows, heads, head_dim, generator=gen)
                mask = torch.ones(rows, ctx_len, dtype=torch.bool)
                mask[:, -rows:] = torch.ones(rows, rows, dtype=torch.bool).tril()  # a chain after the context
                bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).repeat(heads // kv_heads, 1)
                visible = mask.to(torch.uint8)

                def by_torch(q, k, v, c):
                    if args.slots == "consecutive":
                        keys, values = k[int(c[0]) : int(c[-1]) + 1], v[int(c[0]) : int(c[-1]) + 1]
                    else:
                        keys, values = k.index_select(0, c), v.index_select(0, c)
                    return grouped_attention(q, keys.transpose(0, 1), values.transpose(0, 1), bias, scale)

                calls = {"torch": by_torch} | {
                    label: (lambda q, k, v, c, f=f: f(q, k, v, c, visible, scale)) for label, f in kernels.items()}
                times = {label: [] for label in calls}
                for _ in range(args.reps + 1):  # the first is a warm-up
                    for label, call in calls.items():
                        times[label].append(one_pass(call, layers, q, k_pool, v_pool, ctx))
                ms = {label: statistics.median(t[1:]) for label, t in times.items()}
                line = f"| {name} | {ctx_len} | {rows} | {ms['torch']:.2f} | {ms['kernel']:.2f} | " \
                       f"{ms['torch'] / ms['kernel']:.2f}x |"
                if args.against:
                    that = ms[f"kernel@{args.against}"]
                    same = all(torch.equal(*(f(q, k_pool[layer], v_pool[layer], ctx, visible, scale)
                                             for f in kernels.values())) for layer in range(layers))
                    line += f" {that:.2f} | {ms['kernel'] / that:.2f} | {'yes' if same else 'no'} |"
                print(line, flush=True)


if __name__ == "__main__":
    main()
