"""The linear layers of a pass on the CPU: the project's kernel (cloud/avx2_linear.py) for every layer of a model once,
as a pass runs them (weights far larger than the caches, so each is read from memory), by rows (a tree's tokens plus
its root). Random weights in the real models' shapes; ms per pass, medians, passes interleaved.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/linear_bench.py --against ff47cf2

Columns: the kernel as it runs here (AVX-512 where the CPU has it), the same on AVX2 alone, and with `--against
COMMIT` that commit's kernel (its cloud/avx2_linear.cpp, built as this one is), with whether all three give the same
bits: a machine's speed drifts between runs, so only side-by-side figures compare.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from specedge.bench.kernel_at import kernel_at
from specedge.cloud import avx2_linear

SHAPES = {  # layers, then each layer's products as (outputs, inputs): qkv, o, gate and up, down
    "smollm2-135m": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "gemma3-270m": (18, [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]),
}


def linear_at(commit: str) -> ctypes.CDLL:
    """The linear kernel as of `commit`."""
    library = kernel_at(commit, "avx2_linear.cpp")
    p, n = ctypes.c_void_p, ctypes.c_long
    # Later builds take the instruction set last; an earlier one's function ignores the extra argument.
    library.avx2_matmul.argtypes = [p, n, n, p, n, p, ctypes.c_int, ctypes.c_int]
    library.avx2_matmul.restype = None
    return library


def through(library: ctypes.CDLL, instructions: int):
    """x @ W.T on `library` with `instructions` (as avx2_linear.isa says), every build called the same way: the
    module's own call does more in Python (~0.5 ms of a pass's 120 products), which is not the kernel's."""

    def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        panels, k, _ = packed.shape
        y = torch.empty(x.shape[0], panels * avx2_linear.PANEL)
        library.avx2_matmul(x.data_ptr(), x.shape[0], k, packed.data_ptr(), panels * avx2_linear.PANEL,
                            y.data_ptr(), torch.get_num_threads(), instructions)
        return y
    return matmul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,5,7,9,13,17,24,64", help="rows per pass")
    ap.add_argument("--against", metavar="COMMIT", help="also time that commit's kernel, passes interleaved")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not avx2_linear.available():
        raise SystemExit("the AVX2 linear kernel is not available here")
    own = avx2_linear._kernel.library
    calls = {"kernel": through(own, avx2_linear.isa()), "AVX2 alone": through(own, 1)}
    if args.against:
        calls[f"@{args.against}"] = through(linear_at(args.against), 1)
    instructions = "AVX-512" if avx2_linear.isa() == 2 else "AVX2"
    print(f"torch threads {torch.get_num_threads()}; the kernel runs on {instructions} here; ms per pass over every "
          f"layer's products, median of {args.reps}\n")
    print("| model | rows | " + " | ".join(calls) + " | same bits |\n|---|---|" + "---|" * (len(calls) + 1))
    for name, (layers, shapes) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        weights = [[avx2_linear.pack(torch.randn(o, i, generator=gen)) for o, i in shapes] for _ in range(layers)]
        for rows in map(int, args.rows.split(",")):
            x = {i: torch.randn(rows, i, generator=gen) for _, i in shapes}
            times = {label: [] for label in calls}
            for _ in range(args.reps + 1):  # the first is a warm-up
                for label, call in calls.items():
                    start = time.perf_counter()
                    for layer in weights:
                        for w in layer:
                            call(x[w.shape[1]], w)
                    times[label].append((time.perf_counter() - start) * 1e3)
            same = all(len({call(x[w.shape[1]], w).numpy().tobytes() for call in calls.values()}) == 1
                       for w in weights[0])
            ms = " | ".join(f"{statistics.median(t[1:]):.1f}" for t in times.values())
            print(f"| {name} | {rows} | {ms} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
