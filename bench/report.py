"""What `specedge bench` writes: results.json, a Markdown table, plots, and progress while it runs."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def write_results(args, rows: list[dict], store, failures: dict[str, str] | None = None) -> None:
    """results.json, results.md and the table on stdout; `failures`: method -> why it is left out (a peer that
    raised), in both files and on stderr."""
    failures = failures or {}
    results = {
        "rows": rows,
        "failures": failures,
        "config": {k: str(v) for k, v in vars(args).items() if k != "run"},
        "machine": {"python": platform.python_version(), "cpu_count": _cpu_count(),
                    "torch_threads": _torch_threads(), "platform": platform.platform()},
        "datastore": store.meta if store is not None else None,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(rows) + "".join(f"\n**{m} left out**: {why}\n" for m, why in failures.items())
    (args.out / "results.md").write_text(table)
    print(table)
    for m, why in failures.items():
        print(f"specedge bench: {m} left out of the results: {why}", file=sys.stderr)


def markdown(rows: list[dict]) -> str:
    cols = ["method", "category", "n_prompts", "tokens_per_s", "speedup", "decode_speedup", "mean_accepted",
            "draft_ms", "tree_size", "ttft_ms"]
    if rows and "kv_peak_bytes" in rows[0]:
        cols = ["method", "category", "concurrency", "rtt_ms", "n_prompts", "tokens_per_s", "speedup", "baseline",
                "mean_accepted", "passes_per_token", "verifier_ms_per_token", "draft_ms", "tree_size", "tree_policy",
                "overlap", "fill", "verifier_drafted", "kv_peak_bytes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("–" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot_speedup(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * len(methods) / 3), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [next(r["speedup"] for r in rows if r["method"] == m and r["category"] == c) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over own plain decoding (ar)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def plot_serving(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in rows if r["category"] == "all" and r["rtt_ms"] is not None]  # not the in-process baselines
    for (method, rtt) in dict.fromkeys((r["method"], r["rtt_ms"]) for r in rows):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows
                     if r["method"] == method and r["rtt_ms"] == rtt)
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=f"{method} (rtt {rtt:g} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent edge clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)
    if len({r["rtt_ms"] for r in rows}) > 1 or any(r.get("tree_policy") not in (None, "adaptive") for r in rows):
        from specedge.bench.network_report import write_network_report

        runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
        write_network_report(rows, runs, out)


def progress_reporter(total: int):
    """A progress bar on a terminal, plain lines otherwise; call with None to finish."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, file=sys.stderr, unit="run")

        def update(msg):
            if msg is None:
                bar.close()
            else:
                bar.set_postfix_str(msg[-60:])
                bar.update()
        return update
    done = [0]

    def log(msg):
        if msg is not None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {msg}", file=sys.stderr, flush=True)
    return log


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
