"""bench/verifier_idle.py: the verifier's idle time between passes, from the edge's clock and the passes."""

import json

import pytest

from specedge.bench.verifier_idle import idle_by_method, main


def row(method: str = "hybrid") -> dict:
    # 80 ms round trip: a verdict reaches the edge 40 ms after its pass ends
    return {"method": method, "rtt_ms": 80.0, "wall_s": 0.4, "draft_ms": [1.0, 5.0, 10.0, 30.0],
            "sent_ms": [0.0, 10.0, 140.0, 270.0],  # the second and fourth go ahead of the verdict before them
            "verdict_ms": [100.0, 130.0, 280.0, 400.0],
            "compute_ms": [20.0, 20.0, 30.0, 20.0]}


def test_idle_time_is_split_into_serial_rounds_and_trees_ahead_that_came_late():
    m = idle_by_method([row()])["hybrid"]
    # round 1: the pass before ended at 60, this one started at 130 - 40 - 20 = 70, its tree there at 50
    # round 2 (serial): free at 90, started at 210; round 3: free at 240, started at 340, its tree there at 310
    assert m["serial"] == 1 and m["serial_idle_s"] == pytest.approx(0.120)
    assert m["ahead"] == 2 and m["ahead_idle_s"] == pytest.approx(0.010 + 0.100)
    assert m["late"] == 1 and m["late_s"] == pytest.approx(0.070)
    assert m["idle_s"] == pytest.approx(0.230) and m["compute_s"] == pytest.approx(0.090)


def test_rows_without_round_times_are_left_out_and_the_command_says_so(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    runs.write_text(json.dumps({"method": "server-ar", "rtt_ms": 80.0, "wall_s": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="no rows with per-round times"):
        main([str(runs)])
    runs.write_text("\n".join(json.dumps(r) for r in (row("retrieval"), row())) + "\n")
    assert main([str(runs)]) == 0
    out = capsys.readouterr().out
    assert "| retrieval | 1 |" in out and "| hybrid | 1 |" in out
