"""bench/replay.py: a recorded greedy output answers every verification a drafter could ask for, so a
drafter's tokens per pass and speedup come out without the model. The outputs here are made up (replay
checks drafts against whatever was recorded): a text that repeats itself, which retrieval drafts well
once it has seen it once, and a model drafter cannot guess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specedge.bench import specbench

pytestmark = pytest.mark.real_model  # the target's tokenizer

REPO = Path(__file__).resolve().parents[1]
OUTPUT = list(range(1000, 1010)) * 6  # 60 tokens, ten distinct ones


def replay(tmp_path: Path, *args: str) -> dict[tuple[str, str], list[float]]:
    prompts = specbench.load(categories=["summarization", "qa"])
    runs = tmp_path / "runs.jsonl"
    with open(runs, "w") as f:
        for p in prompts[:2] + prompts[-2:]:
            row = {"method": "server-ar", "prompt": p.id, "category": p.category, "tokens": OUTPUT}
            f.write(json.dumps(row) + "\n")
    out = subprocess.run([sys.executable, "bench/replay.py", str(runs), "--categories", "summarization,qa", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    return {(r[0], r[1]): [float(x) for x in r[2:]] for r in rows}


def test_replay_counts_tokens_per_pass_and_the_modelled_speedup(tmp_path):
    table = replay(tmp_path, "--drafters", "retrieval")
    assert set(table) == {("retrieval", c) for c in ("all", "summarization", "qa")}
    accepted, nodes, speedup, *_ = table["retrieval", "all"]
    assert accepted > 3 and nodes >= accepted - 1 and speedup > 1.5


def test_timed_replay_leaves_out_a_categorys_first_prompts_and_times_passes_for_real(tmp_path):
    table = replay(tmp_path, "--drafters", "retrieval", "--skip-per-category", "1", "--timed", "--base-ms", "20",
                   "--rtt-ms", "10")
    accepted, _, speedup, *_ = table["retrieval", "all"]
    # A round costs a pass of at least 20 ms plus 10 ms of network, plain decoding 20 ms per token.
    assert accepted > 3 and 1.0 < speedup < accepted * 20 / 30


def test_replay_writes_rows_that_category_intervals_reads_with_the_printed_speedup(tmp_path):
    from specedge.bench.category_intervals import category_intervals

    out = tmp_path / "replayed.jsonl"
    table = replay(tmp_path, "--drafters", "retrieval,suffix", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({r["method"] for r in rows}) == ["ar", "retrieval", "suffix"] and len(rows) == 3 * 4
    by_category = {r["category"]: r for r in category_intervals(rows, "retrieval", ["suffix"], baseline="ar")}
    for category in ("summarization", "qa", "all"):
        speed = by_category[category]["speed"]
        assert speed["retrieval"] == pytest.approx(table["retrieval", category][2], abs=0.01)
        assert speed["suffix"] == pytest.approx(table["suffix", category][2], abs=0.01)
