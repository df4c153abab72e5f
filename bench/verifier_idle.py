"""Where the verifier waited: from the runs.jsonl of a `specedge bench` run with one client and an emulated
round trip (`--rtt-ms`, no jitter), the time the verifier sat idle between one pass and the next, per method,
split by what it waited for: a serial round's tree (sent after the verdict before it: a round trip and the
edge's drafting), or a tree sent ahead of that verdict that reached it after the pass before had ended (the
edge's drafting outlasted the pass).

Each round's times come from the edge's clock (`sent_ms`, `verdict_ms`) and the verifier's pass (`compute_ms`),
with the emulated delay taken as half the round trip each way: a pass starts half a round trip and its own
length before its verdict reaches the edge, and the verifier is free half a round trip before the verdict
before it reaches the edge. The first round (the prompt's prefill) is left out.

    python -m specedge.bench.verifier_idle bench-out/NAME/runs.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

FIELDS = ("generations", "wall_s", "compute_s", "draft_s", "idle_s", "serial", "serial_idle_s", "ahead",
          "ahead_idle_s", "late", "late_s")


def idle_by_method(rows: Iterable[dict]) -> dict[str, dict[str, float]]:
    """Per method, the sums of FIELDS over its generations (rows without per-round times are skipped)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    for row in rows:
        if not row.get("verdict_ms") or row.get("rtt_ms") is None:
            continue
        half = row["rtt_ms"] / 2
        sent, verdict, compute = row["sent_ms"], row["verdict_ms"], row["compute_ms"]
        m = out[row["method"]]
        m["generations"] += 1
        m["wall_s"] += row["wall_s"]
        m["compute_s"] += sum(compute) / 1e3
        m["draft_s"] += sum(row["draft_ms"]) / 1e3
        for i in range(1, len(verdict)):
            free = verdict[i - 1] - half  # the pass before ended
            idle = max(0.0, verdict[i] - half - compute[i] - free) / 1e3
            m["idle_s"] += idle
            if sent[i] >= verdict[i - 1]:  # drafted after the verdict before it came in
                m["serial"] += 1
                m["serial_idle_s"] += idle
            else:
                m["ahead"] += 1
                m["ahead_idle_s"] += idle
                late = min(idle, max(0.0, sent[i] + half - free) / 1e3)
                m["late"] += late > 0.001
                m["late_s"] += late
    return dict(out)


def table(by_method: dict[str, dict[str, float]]) -> str:
    head = ("| method | generations | wall s | verifier compute s | edge drafting s | verifier idle s | serial rounds "
            "| their idle s | trees ahead | their idle s | of which waiting on a late tree s (trees) |")
    lines = [head, "|" + "---|" * 11]
    for method, m in by_method.items():
        lines.append(f"| {method} | {m['generations']:.0f} | {m['wall_s']:.1f} | {m['compute_s']:.1f} | "
                     f"{m['draft_s']:.1f} | {m['idle_s']:.1f} | {m['serial']:.0f} | {m['serial_idle_s']:.1f} | "
                     f"{m['ahead']:.0f} | {m['ahead_idle_s']:.1f} | {m['late_s']:.1f} ({m['late']:.0f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, help="runs.jsonl written by specedge bench (one client, --rtt-ms)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    by_method = idle_by_method(rows)
    if not by_method:
        raise SystemExit(f"{args.runs}: no rows with per-round times (a run before they were recorded?)")
    print(table(by_method))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
