"""Is one method at least as fast as the better of the others in every category, beyond what a few prompts
can tell? From the runs.jsonl of one or more `specedge bench` runs (same methods, any prompts; a prompt run
in several of them counts once per run): per category, each method's speed against the baseline (tokens over
wall time, summed over the category's prompts), the method's ratio to the best of the others there, and a
bootstrap interval of that ratio over the category's prompts. The interval covers the choice of prompts
only, not what differs between runs (the drafters' state carried from earlier prompts, the machine): two
runs of six prompts per category differed by up to 7% in a category (BENCHMARKS.md section 6), so pool
several runs before judging one, or run an A/A copy beside the methods (bench/perturbed.py: with 10
prompts a category it moved categories by up to 6.5% in one run).

    python -m specedge.bench.category_intervals RUNS.jsonl [RUNS.jsonl ...] [--method hybrid]
        [--against retrieval,model:smollm2-135m] [--baseline server-ar]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

RESAMPLES = 2000
LEVEL = 0.90


def category_intervals(runs: list[dict], method: str, against: list[str], baseline: str,
                       seed: int = 0) -> list[dict]:
    """One row per category (in first-seen order) and one for all: `speed` per method (vs `baseline`),
    `ratio` of `method` to the fastest of `against` minus one, its `low` and `high` bound, `prompts`."""
    methods = [baseline, *against, method]
    # (category) -> key of one prompt's run -> method -> (tokens, wall seconds)
    table: dict[str, dict[tuple, dict[str, tuple[int, float]]]] = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r["method"] in methods:
            key = (r.get("source", ""), r["prompt"], r.get("rep", 0), r.get("rtt_ms"), r.get("concurrency"))
            table[r["category"]][key][r["method"]] = (len(r["tokens"]), r["wall_s"])
    rng = np.random.default_rng(seed)
    rows = []
    everything = {(category, key): done for category, keys in table.items() for key, done in keys.items()}
    for category, keyed in [*table.items(), ("all", everything)]:
        complete = [done for done in keyed.values() if all(m in done for m in methods)]
        if not complete:
            continue
        tokens = np.array([[done[m][0] for m in methods] for done in complete], dtype=float)  # [prompts, methods]
        wall = np.array([[done[m][1] for m in methods] for done in complete])
        picks = rng.integers(0, len(complete), size=(RESAMPLES, len(complete)))
        speed = tokens.sum(0) / wall.sum(0)
        resampled = tokens[picks].sum(1) / wall[picks].sum(1)  # [RESAMPLES, methods]
        ratios = resampled[:, -1] / resampled[:, 1:-1].max(1)
        low, high = np.quantile(ratios, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        rows.append({"category": category, "prompts": len(complete),
                     "speed": {m: float(s / speed[0]) for m, s in zip(methods, speed)},
                     "ratio": float(speed[-1] / speed[1:-1].max() - 1), "low": float(low - 1), "high": float(high - 1)})
    return rows


def markdown(rows: list[dict], method: str, against: list[str]) -> str:
    head = ["category", "prompts", *against, method, f"{method} vs the better", f"{LEVEL:.0%} interval"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["category"], str(r["prompts"]), *(f"{r['speed'][m]:.3f}x" for m in [*against, method]),
                 f"{r['ratio']:+.1%}", f"[{r['low']:+.1%}, {r['high']:+.1%}]"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="runs.jsonl files written by specedge bench")
    p.add_argument("--method", default="hybrid")
    p.add_argument("--against", default="retrieval,model:smollm2-135m",
                   help="comma-separated; those absent from the runs are left out")
    p.add_argument("--baseline", default="server-ar")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        runs += [{**json.loads(line), "source": str(path)} for line in path.read_text().splitlines() if line.strip()]
    present = {r["method"] for r in runs}
    for name in (args.method, args.baseline):
        if name not in present:
            raise SystemExit(f"no runs of {name!r} in {', '.join(map(str, args.runs))}; methods: {sorted(present)}")
    against = [m for m in args.against.split(",") if m in present]
    if not against:
        raise SystemExit(f"none of {args.against!r} in the runs; methods: {sorted(present)}")
    print(markdown(category_intervals(runs, args.method, against, args.baseline), args.method, against), end="")


if __name__ == "__main__":
    main()
