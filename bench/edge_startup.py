"""Edge start-up figures (BENCHMARKS.md, "Edge start-up"): a fresh client process of a venv holding only
specedge[edge], against `specedge serve` on loopback.

    .venv/bin/python bench/edge_startup.py --out bench-out/edge [--model smollm2-135m] [--runs 5]

Per run, in a new process: the time to import the SDK, to connect and get the tokenizer (fetched from the
verifier on the first run, from the client's cache after), the first token's time, the whole generation
and the process's peak resident memory. Also the size on disk of every distribution the edge venv holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from specedge.bench.edge_venv import CLIENT_SCRIPT, build_edge_venv, installed_packages
from specedge.cloud.config import DEFAULT_MODEL
from specedge.cloud.launch import VerifierProcess

PROMPT = "Summarize: The committee met on Tuesday to review the bridge repair plan. Engineers said the north " \
         "span needs new bearings before winter; the committee approved the work."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--runs", type=int, default=5, help="client processes after the first (cold) one")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench-out/edge"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        python = build_edge_venv(Path(tmp))
        sizes = installed_packages(python)
        env = {**os.environ, "SPECEDGE_CACHE": str(Path(tmp) / "edge-cache")}  # starts empty: the first run fetches
        with VerifierProcess("--model", args.model) as verifier:
            runs = []
            for i in range(1 + args.runs):
                done = subprocess.run([str(python), "-c", CLIENT_SCRIPT, verifier.target, PROMPT,
                                       str(args.max_new_tokens)], env=env, capture_output=True, text=True,
                                      check=True, cwd=tmp)
                runs.append({k: v for k, v in json.loads(done.stdout).items() if k not in ("token_ids", "text")})
                print(("cold " if i == 0 else "warm ") + json.dumps(runs[-1]), flush=True)
    warm = runs[1:]
    summary = {
        "model": args.model,
        "cold": runs[0],
        "warm_median": {k: round(statistics.median(r[k] for r in warm), 3)
                        for k in ("import_s", "connect_and_tokenizer_s", "ttft_s", "generate_s", "peak_rss_mb")},
        "installed_mb": {name: round(b / 2**20, 1) for name, b in sorted(sizes.items(), key=lambda kv: -kv[1])},
        "installed_total_mb": round(sum(sizes.values()) / 2**20, 1),
    }
    m = summary["warm_median"]
    summary["warm_median"]["import_connect_tokenizer_s"] = round(m["import_s"] + m["connect_and_tokenizer_s"], 3)
    (args.out / "edge_startup.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
