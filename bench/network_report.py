"""The edge-network report: how each method fares as the round trip grows, from what `specedge bench` wrote
in gRPC mode (results.json's rows, runs.jsonl's rounds). Writes network-report.md and four plots:

- tps_vs_rtt.png: tokens/s by round trip, one line per method (remote-ar: one token per round trip);
- tree_size_vs_rtt.png: the draft nodes sent per round, adaptive and fixed;
- acceptance_by_depth.png: the share of rounds that accepted at least d draft tokens;
- round_split.png: the mean round split into drafting, network, the verifier's queue and its pass.

`specedge bench` writes it when a run has several round trips or tree sizes;
`python -m specedge.bench.network_report OUT_DIR` writes it again from a finished run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

PARTS = ("round_draft_ms", "round_network_ms", "round_queue_ms", "round_compute_ms")
MAX_DEPTH = 16


def write_network_report(rows: list[dict], runs: list[dict], out: Path) -> None:
    rows = [r for r in rows if r["category"] == "all" and r.get("rtt_ms") is not None]
    if not rows:
        return
    concurrency = min(r["concurrency"] for r in rows)
    rows = [r for r in rows if r["concurrency"] == concurrency]
    runs = [r for r in runs if r.get("concurrency") == concurrency and r.get("rtt_ms") is not None]
    import matplotlib

    matplotlib.use("Agg")
    _plot_lines(rows, "tokens_per_s", "tokens/s (one client)", out / "tps_vs_rtt.png")
    _plot_lines([r for r in rows if r.get("tree_policy")], "tree_size", "draft nodes sent per round (mean)",
                out / "tree_size_vs_rtt.png")
    _plot_acceptance(runs, out / "acceptance_by_depth.png")
    _plot_split(rows, out / "round_split.png")
    (out / "network-report.md").write_text(_markdown(rows, concurrency))


def _methods(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def _plot_lines(rows: list[dict], field: str, label: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in _methods(rows):
        pts = sorted((r["rtt_ms"], r[field]) for r in rows if r["method"] == method and r[field] is not None)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=method)
    ax.set_xlabel("round trip (ms)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance_by_depth(runs: list[dict]) -> dict[str, list[float]]:
    """Method -> share of rounds with a draft that accepted at least d draft tokens, d = 1..MAX_DEPTH."""
    accepted = defaultdict(list)
    for run in runs:
        accepted[run["method"]] += [a for a, sent in zip(run.get("accepted", []), run.get("tree_sizes", [])) if sent]
    return {m: [sum(a >= d for a in counts) / len(counts) for d in range(1, MAX_DEPTH + 1)]
            for m, counts in accepted.items() if counts}


def _plot_acceptance(runs: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, shares in acceptance_by_depth(runs).items():
        ax.plot(range(1, MAX_DEPTH + 1), shares, marker=".", label=method)
    ax.set_xlabel("depth d (draft tokens)")
    ax.set_ylabel("rounds accepting >= d draft tokens")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_split(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    bars = [r for r in rows if r.get("round_compute_ms") is not None]
    fig, ax = plt.subplots(figsize=(max(6.5, 0.45 * len(bars)), 4.5))
    bottom = [0.0] * len(bars)
    for part in PARTS:
        values = [r.get(part) or 0.0 for r in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=part.removeprefix("round_").removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(bars)), [f"{r['method']} {r['rtt_ms']:g}ms" for r in bars], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("mean round (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(rows: list[dict], concurrency: int) -> str:
    by = {(r["method"], r["rtt_ms"]): r for r in rows}
    rtts = sorted({r["rtt_ms"] for r in rows})
    lines = [f"# Across round trips ({concurrency} client{'s' if concurrency > 1 else ''})", "",
             "tokens/s by round trip (ms); in brackets, draft nodes sent per round and tokens per pass.", "",
             "| method | " + " | ".join(f"{t:g} ms" for t in rtts) + " |", "|---|" + "---|" * len(rtts)]
    for method in _methods(rows):
        cells = []
        for t in rtts:
            r = by.get((method, t))
            extra = "" if r is None or r["mean_accepted"] is None \
                else f" ({r['tree_size'] or 0:g}, {r['mean_accepted']:g})"
            cells.append("–" if r is None else f"{r['tokens_per_s']:g}{extra}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios per round trip (from the medians above):", ""]
    for t in rtts:
        lines.append(f"- {t:g} ms: " + "; ".join(_ratios(by, rows, t)))
    lines += ["", "The mean round (ms): drafting, network, the verifier's queue and pass.", "",
              "| method | rtt | draft | network | queue | compute |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("round_compute_ms") is not None:
            lines.append(f"| {r['method']} | {r['rtt_ms']:g} | " + " | ".join(
                "–" if r.get(p) is None else f"{r[p]:g}" for p in PARTS) + " |")
    return "\n".join(lines) + "\n"


def _ratios(by: dict, rows: list[dict], rtt: float) -> list[str]:
    """Each adaptive drafter against its best fixed size, remote-ar, its own 0 ms speed, itself without
    trees sent ahead (DRAFTER/serial) and without the verifier's drafts for them (DRAFTER/nofill)."""
    out = []
    for r in rows:
        if r["rtt_ms"] != rtt or r.get("tree_policy") != "adaptive":
            continue
        fixed = [f for f in rows if f["rtt_ms"] == rtt and f["method"].startswith(r["method"] + "@")
                 and f.get("overlap") == r.get("overlap") and f.get("fill") == r.get("fill")]
        if fixed:
            best = max(fixed, key=lambda f: f["tokens_per_s"])
            out.append(f"{r['method']} / best fixed ({best['method']}) {r['tokens_per_s'] / best['tokens_per_s']:.2f}x")
        if (remote := by.get(("remote-ar", rtt))) is not None:
            out.append(f"{r['method']} / remote-ar {r['tokens_per_s'] / remote['tokens_per_s']:.2f}x")
        if r.get("overlap") and (serial := by.get((r["method"] + "/serial", rtt))) is not None:
            out.append(f"{r['method']} overlap on / off {r['tokens_per_s'] / serial['tokens_per_s']:.2f}x "
                       f"({r['ahead_rounds']} rounds sent ahead)")
        if r.get("fill") and (unfilled := by.get((r["method"] + "/nofill", rtt))) is not None:
            out.append(f"{r['method']} fill on / off {r['tokens_per_s'] / unfilled['tokens_per_s']:.2f}x "
                       f"({r['verifier_drafted']:.0%} of its tokens drafted by the verifier)")
        if rtt != 0 and (still := by.get((r["method"], 0.0))) is not None:
            out.append(f"{r['method']} keeps {r['tokens_per_s'] / still['tokens_per_s']:.0%} of its 0 ms speed")
    return out or ["–"]


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    rows = json.loads((out / "results.json").read_text())["rows"]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    write_network_report(rows, runs, out)
    print(out / "network-report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
