"""Gemma 3 270M's output layer by rows, one core: fbgemm's int8 kernel (2 activation rows per verified row,
plus the pinning row: cloud/int8_argmax.py), the whole exact int8 top-1, and the float32 layer.

    taskset -c 1 .venv/bin/python bench/int8_rows.py
"""

from __future__ import annotations

import time
import warnings

import torch

from specedge.cloud.int8_argmax import Int8Argmax
from specedge.cloud.linear import Linear
from specedge.cloud.model_registry import load_model


def median_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    hf, _ = load_model("gemma3-270m")
    weight = hf.get_output_embeddings().weight.detach().float().contiguous()
    fast, layer = Int8Argmax.build(weight), Linear(weight)
    print("| rows | int8 kernel ms | exact int8 top-1 ms | float32 ms |\n|---|---|---|---|")
    for n in (1, 2, 4, 8, 12, 16, 24, 32):
        h = torch.randn(n, weight.shape[1])
        x = torch.cat([torch.randint(-63, 64, (2 * n, weight.shape[1])).float(), fast._pin])
        kernel = median_ms(lambda: torch.ops.quantized.linear_dynamic(x, fast.packed, True))
        top1 = f"{median_ms(lambda: fast.top_k(h, 1)):.1f}" if n <= 12 else "-"
        print(f"| {n} | {kernel:.1f} | {top1} | {median_ms(lambda: layer(h)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
