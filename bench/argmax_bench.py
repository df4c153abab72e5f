"""A greedy step's output layer on the CPU by rows: the int8 argmax (cloud/int8_argmax.py, what `OutputLayer.argmax`
uses up to its max_rows) against float32 logits through the linear layer and their argmax, on the final hidden
states of real text (a Spec-Bench summarization prompt); both give the same ids (checked). ms, median of 9. Where
the CPU has AVX-512 VNNI, the int8 argmax is timed with the kernel's AVX2 path as well (what CPUs without it run, up to its 12 rows).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/argmax_bench.py smollm2-135m gemma3-270m
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specedge.bench import specbench
from specedge.cloud.model_registry import load_model
from specedge.cloud.output_layer import OutputLayer


def median_ms(fn, reps: int = 9) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    print("| model | rows | int8 argmax | int8, AVX2 path | float32 logits + argmax |\n|---|---|---|---|---|")
    text = specbench.load(categories=["summarization"])[0].text
    for name in sys.argv[1:] or ["smollm2-135m", "gemma3-270m"]:
        hf, tokenizer = load_model(name)
        ids = torch.tensor([tokenizer(text)["input_ids"][:300]])
        with torch.inference_mode():
            hidden = hf.model(ids).last_hidden_state[0, -32:].contiguous()  # normed, as the output layer takes
        head = OutputLayer(hf.lm_head.weight, getattr(getattr(hf.config, "text_config", hf.config),
                                                      "final_logit_softcapping", None))
        head.prepare()
        for rows in [1, 2, 4, 8, 12, 16, 24, 32]:
            h = hidden[:rows]
            assert torch.equal(head.argmax(h), head.logits(h).argmax(-1))
            int8 = median_ms(lambda: head.argmax(h))
            avx2 = "-"
            if head._fast.isa == 2:
                head._fast.isa = 1
                avx2 = f"{median_ms(lambda: head.argmax(h)):.1f}"
                head._fast.isa = 2
            fp32 = median_ms(lambda: head.logits(h).argmax(-1))
            print(f"| {name} | {rows} | {int8:.1f} | {avx2} | {fp32:.1f} |", flush=True)


if __name__ == "__main__":
    main()
