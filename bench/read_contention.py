"""Does an edge drafter reading beside the verifier slow the verifier's pass? The question behind the hybrid's
choice to let its model read committed text during every pass (edge/hybrid.py): in the benchmarks edge and
verifier run on two cores of one machine, which share caches and memory bandwidth.

    .venv/bin/python bench/read_contention.py --seconds 25 --reps 2

Gemma 3's verification passes (a 16-token chain after a 300-token prefix, one thread on core 1) are timed
alone and while SmolLM2's GGUF (llama.cpp, one thread on core 0) reads tokens in 8-token batches without
pause, interleaved, `--reps` times; medians per pass. Linux only (taskset).

It measured +3% (BENCHMARKS.md section 6), far less than the benchmark itself shows: there the verifier's
reported per-pass compute was ~15% higher for the same trees while the hybrid's model read beside it. What
this probe misses of the real setting is not known yet (the verifier as a gRPC server process, its shorter
passes, the reader's pace): read its figure as a lower bound.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

VERIFIER = """
import statistics, sys, time, torch
torch.set_num_threads(1)
from specedge.cloud.engine import Engine
from specedge.cloud.local import LocalVerifier
from specedge.cloud.model_registry import load_model
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
hf, _ = load_model("gemma3-270m")
verifier = LocalVerifier(Engine.from_hf_model(hf, kv_pool_bytes=256 << 20))
times, end = [], time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    session = verifier.open(list(range(100, 400)), SamplingParams(max_new_tokens=10**6))
    for _ in range(10):
        start = time.perf_counter()
        session.step(DraftTree(list(range(500, 516)), [-1, *range(15)], accept_probs=[0.5] * 16))
        times.append((time.perf_counter() - start) * 1e3)
    session.close()
print(statistics.median(times))
"""

READER = """
from specedge.edge.draft_model import DraftModel
from specedge.edge.draft_models import draft_model_path
model = DraftModel(draft_model_path("smollm2-135m"), threads=1)
tokens = list(range(1000, 1400))
print("reading", flush=True)
while True:
    for end in range(8, len(tokens), 8):
        model.prefill(tokens[:end])
"""


def verifier_pass_ms(seconds: float) -> float:
    out = subprocess.run(["taskset", "-c", "1", sys.executable, "-c", VERIFIER, str(seconds)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=25.0, help="verifier passes timed per measurement")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    alone, beside = [], []
    for rep in range(args.reps):
        alone.append(verifier_pass_ms(args.seconds))
        reader = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", READER], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert reader.stdout.readline().strip() == "reading"
            time.sleep(1.0)
            beside.append(verifier_pass_ms(args.seconds))
        finally:
            reader.kill()
            reader.wait()
        print(f"rep {rep + 1}: pass {alone[-1]:.1f} ms alone, {beside[-1]:.1f} ms beside the reader", file=sys.stderr)
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"verifier pass (median of {args.reps}): {a:.1f} ms alone, {b:.1f} ms beside a reading drafter "
          f"({(b / a - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
