"""bench/round_split.py: a served round's legs, the verifier in a child process marking them by wrapping the
service's, scheduler's and engine's own methods. These runs are short and check only that every leg is
measured (the script fails, rather than reporting nonsense, when a method it wraps changes); the figures
themselves belong in BENCHMARKS.md section 9."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def legs(*args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "bench/round_split.py", "--rounds", "30", "--reps", "1", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("rep 0: ")]
    pairs = (leg.rsplit(" ", 1) for leg in line.removeprefix("rep 0: ").removesuffix(" ms").split(", "))
    return {name: float(ms) for name, ms in pairs}


@pytest.mark.real_model
def test_a_served_rounds_legs_are_each_measured():
    got = legs("--model", "smollm2-135m", "--generate")
    parts = ["send -> parsed", "parsed -> submitted", "submitted -> step", "step -> verdict built",
             "verdict built -> client"]
    host = {"verifier CPU outside the step", "Generate: verifier CPU outside the step a token"}
    assert set(parts) | {"step", "outside the step"} | host == set(got)
    assert all(got[leg] >= 0 for leg in parts)  # a short leg may print as 0.00 ms
    assert all(got[total] > 0 for total in ["step", "outside the step", *host])


@pytest.mark.parametrize("tls", ["plain", "mutual"])
def test_the_bare_grpc_floor_holds_each_round_and_reports_what_is_outside_the_hold(tls):
    got = legs("--floor-ms", "5", "--tls", tls)
    assert set(got) == {"outside the hold"}
    assert got["outside the hold"] > 0
