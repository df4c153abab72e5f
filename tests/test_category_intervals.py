"""bench/category_intervals.py: a method against the better of the others per category, with a bootstrap
interval over the category's prompts (synthetic runs.jsonl rows: the arithmetic is what is specified)."""

from __future__ import annotations

import json

import pytest

from specedge.bench.category_intervals import category_intervals, main


def run(method: str, category: str, prompt: str, wall_s: float, tokens: int = 96) -> dict:
    return {"method": method, "category": category, "prompt": prompt, "rep": 0, "tokens": [7] * tokens,
            "wall_s": wall_s}


def runs_of(walls: dict[str, dict[str, list[float]]]) -> list[dict]:
    return [run(method, category, f"{category}-{i}", wall)
            for category, by_method in walls.items() for method, ws in by_method.items() for i, wall in enumerate(ws)]


def test_a_method_ahead_on_every_prompt_is_ahead_by_that_much_with_no_doubt():
    runs = runs_of({"math": {"server-ar": [10, 12, 8], "retrieval": [5, 6, 4], "model": [6, 6, 6],
                             "hybrid": [5 / 1.1, 6 / 1.1, 4 / 1.1]}})
    math, everything = category_intervals(runs, "hybrid", ["retrieval", "model"], "server-ar")
    assert math["category"] == "math" and everything["category"] == "all"
    assert math["prompts"] == 3
    assert math["speed"]["retrieval"] == pytest.approx(2.0)  # 30 s against 15 s for the same tokens
    assert math["ratio"] == pytest.approx(0.1)
    assert math["low"] == pytest.approx(0.1) and math["high"] == pytest.approx(0.1)


def test_a_method_ahead_on_some_prompts_and_behind_on_others_gets_an_interval_across_zero():
    runs = runs_of({"rag": {"server-ar": [10] * 6, "retrieval": [5] * 6, "hybrid": [4, 4, 4, 6, 6, 6]}})
    rag, _ = category_intervals(runs, "hybrid", ["retrieval"], "server-ar")
    assert rag["ratio"] == pytest.approx(0.0)
    assert rag["low"] < 0 < rag["high"]


def test_the_better_of_the_others_is_chosen_per_category_and_a_prompt_missing_a_method_is_left_out():
    runs = runs_of({"writing": {"server-ar": [10, 10], "retrieval": [5, 5], "model": [4, 4], "hybrid": [4, 4]},
                    "qa": {"server-ar": [10, 10], "retrieval": [2, 2], "model": [8, 8], "hybrid": [2.5, 2.5]}})
    runs.append(run("retrieval", "qa", "qa-unfinished", 1.0))  # no other method ran it
    writing, qa, everything = category_intervals(runs, "hybrid", ["retrieval", "model"], "server-ar")
    assert writing["ratio"] == pytest.approx(0.0)  # level with the model, which is better than retrieval there
    assert qa["ratio"] == pytest.approx(-0.2) and qa["prompts"] == 2  # behind retrieval, the better there
    assert everything["prompts"] == 4


def test_the_command_line_names_what_is_missing(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    walls = {"qa": {"server-ar": [10], "retrieval": [5], "model": [4]}}
    path.write_text("\n".join(json.dumps(r) for r in runs_of(walls)))
    with pytest.raises(SystemExit, match="no runs of 'hybrid'"):
        main([str(path)])
    main([str(path), "--method", "model", "--against", "retrieval,model:smollm2-135m"])  # (the second did not run)
    assert "| qa | 1 | 2.000x | 2.500x | +25.0% | [+25.0%, +25.0%] |" in capsys.readouterr().out
