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
                   "--rtt-ms", "10", "--serial")
    accepted, _, speedup, *_ = table["retrieval", "all"]
    # A serial round costs a pass of at least 20 ms plus 10 ms of network, plain decoding 20 ms per token.
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


def engine_bench_results(path: Path, steps_ms: dict[int, float]) -> Path:
    """bench/engine_bench.py's results.json with greedy steps of these times (made up) by draft tokens."""
    rows = [{"tree_tokens": n, "ms": ms, "greedy_ms": ms, "relative": 1.0} for n, ms in steps_ms.items()]
    path.write_text(json.dumps({"models": {"smollm2-135m": {"verify_cost": rows}}}))
    return path


def test_replay_prices_passes_by_the_greedy_steps_engine_bench_measured(tmp_path):
    flat = engine_bench_results(tmp_path / "flat.json", {n: 20.0 for n in (0, 1, 4, 16, 64)})
    measured = replay(tmp_path, "--drafters", "retrieval", "--cost", f"cpu:{flat}:smollm2-135m")
    priced = replay(tmp_path, "--drafters", "retrieval", "--cost", "flat", "--base-ms", "20")
    assert measured.keys() == priced.keys()
    for key, (accepted, nodes, speedup, *_) in measured.items():  # the speedup counts the drafting's own time too
        assert [accepted, nodes] == priced[key][:2] and speedup == pytest.approx(priced[key][2], rel=0.02)
    steep = engine_bench_results(tmp_path / "steep.json", {0: 20.0, 1: 40.0, 64: 400.0})
    accepted, _, speedup, *_ = replay(tmp_path, "--drafters", "retrieval", "--cost", f"cpu:{steep}:smollm2-135m")[
        "retrieval", "all"]
    assert speedup < measured["retrieval", "all"][2]


def test_measured_steps_never_get_cheaper_with_more_tokens_and_must_include_plain_decoding(tmp_path):
    from specedge.bench.replay import greedy_step_costs

    cost = greedy_step_costs(engine_bench_results(tmp_path / "a.json", {0: 30.0, 1: 33.0, 2: 31.0, 4: 40.0}),
                             "smollm2-135m")
    assert [cost.ms(n) for n in (0, 1, 2, 4)] == [30.0, 33.0, 33.0, 40.0]
    with pytest.raises(ValueError, match="--tree-tokens 0"):
        greedy_step_costs(engine_bench_results(tmp_path / "b.json", {1: 33.0, 4: 40.0}), "smollm2-135m")


def pipelined_session(rtt_ms: float, output: list[int]):
    """A replay session over `rtt_ms` whose passes cost 50 ms plus 1 ms a node, after a 400 ms prefill."""
    from specedge.bench.replay import PREFILL_MS_PER_TOKEN, PipelinedReplaySession
    from specedge.common.cost_model import CostModel

    prompt = list(range(500, 500 + round(400 / PREFILL_MS_PER_TOKEN)))
    cost = CostModel(((0, 50.0), (100, 150.0)))
    return PipelinedReplaySession(prompt, output, 2000, cost, timed=True, rtt_ms=rtt_ms)


def test_a_tree_sent_ahead_is_verified_less_what_the_verdict_before_it_committed_a_pass_later():
    from specedge.common.draft_tree import DraftTree

    session = pipelined_session(80.0, OUTPUT)
    prompt_length = len(session.prompt_ids)
    session.send(DraftTree.chain(OUTPUT[:3]))  # all accepted, and the bonus token OUTPUT[3]
    # Sent ahead from the same root, guessing the bonus token right: what is left is OUTPUT[4:6]
    session.send(DraftTree.chain(OUTPUT[:6]), root_length=prompt_length)
    (first_back, first), (second_back, second) = session._verdicts
    assert first.tokens == OUTPUT[:4] and first.accepted == [0, 1, 2]
    assert second.tokens == OUTPUT[4:7] and second.accepted == [0, 1]
    # The second tree arrived while the first was verified: its verdict is a pass (52 ms) later, not a round
    # trip and a pass; it waited in the verifier's queue for the prefill and first pass (453 ms, less the
    # time between the two sends).
    assert second_back - first_back == pytest.approx(0.052, abs=1e-6)
    assert second.queue_ms > 300
    assert session.receive().tokens == OUTPUT[:4] and session.receive().tokens == OUTPUT[4:7]


def test_where_nothing_of_a_tree_ahead_is_left_the_verifier_drafts_and_the_client_sees_no_node_accepted():
    from specedge.common.draft_tree import DraftTree

    session = pipelined_session(0.0, OUTPUT)
    # All accepted, and the bonus token: OUTPUT[:11] committed. (The client's notes, here a hybrid's, do not
    # travel: the verifier's drafter learns from the tree as the wire carries it.)
    session.send(DraftTree(OUTPUT[:10], list(range(-1, 9)), notes=[object()] * 10))
    # Ahead from the same root, a wrong guess at the bonus token: nothing of it is left after that verdict
    session.send(DraftTree.chain([1, 2]), root_length=len(session.prompt_ids), fill_tokens=16)
    filled = session._verdicts[-1][1]
    # The verifier drafted by retrieval over the text so far (it repeats), and all it committed is the output
    assert filled.accepted == [] and filled.verifier_drafted > 0
    assert filled.tokens == OUTPUT[11 : 12 + filled.verifier_drafted]
    # Without fill_tokens the same tree's pass commits the bonus token only
    session.send(DraftTree.chain([1, 2]), root_length=len(session.prompt_ids) + 11)
    assert session._verdicts[-1][1].tokens == [OUTPUT[12 + filled.verifier_drafted]]


def test_timed_replay_over_a_round_trip_sends_trees_ahead_unless_serial(tmp_path):
    def row(*extra: str) -> list[float]:
        return replay(tmp_path, "--drafters", "retrieval", "--timed", "--base-ms", "10", "--rtt-ms", "60", *extra)[
            "retrieval", "all"]

    accepted, _, speedup, *_, ahead = row()
    # Rounds overlap on the network, not on the verifier: passes of at least 10 ms, one at a time.
    assert ahead > 0.2 and 1.0 < speedup < accepted
    accepted, _, speedup, *_, ahead = row("--serial")
    assert ahead == 0.0 and speedup < accepted * 10 / 70


def test_timed_rows_carry_each_rounds_times_from_which_the_verifiers_idle_time_is_told(tmp_path):
    from specedge.bench.category_intervals import category_intervals
    from specedge.bench.verifier_idle import idle_by_method

    def idle(*extra: str) -> dict[str, float]:
        out = tmp_path / "replayed.jsonl"
        table = replay(tmp_path, "--drafters", "retrieval,suffix", "--timed", "--base-ms", "10", "--rtt-ms", "60",
                       "--out", str(out), *extra)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        # Every row carries the round trip, plain decoding's too, so that category_intervals pairs them.
        assert {r["rtt_ms"] for r in rows} == {60.0}
        (everything,) = [c for c in category_intervals(rows, "retrieval", ["suffix"], "ar") if c["category"] == "all"]
        assert everything["speed"]["retrieval"] == pytest.approx(table["retrieval", "all"][2], abs=0.01)
        rows = [r for r in rows if r["method"] == "retrieval"]
        assert all(len(r[k]) == r["rounds"] for r in rows for k in ("sent_ms", "verdict_ms", "compute_ms"))
        m = idle_by_method(rows)["retrieval"]
        # A tree that went out before the verdict before it came back is one the generation sent ahead.
        assert m["generations"] == 4 and m["ahead"] == sum(r["ahead"] for r in rows)
        return m

    serial = idle("--serial")
    # Every round after the first waits for the verdict before it: the verifier idles a round trip each time.
    assert serial["ahead"] == 0 and serial["serial"] > 0 and serial["serial_idle_s"] >= 0.060 * serial["serial"]
    pipelined = idle()
    # Trees sent ahead keep the verifier busy through part of each round trip.
    assert pipelined["ahead"] > pipelined["serial"] and pipelined["idle_s"] < serial["idle_s"]


def test_an_aa_copy_replays_beside_its_original_with_the_same_outputs(tmp_path):
    """`NAME~` (bench/perturbed.py): the drafter with one unrelated earlier output in its history. The
    replay asserts every generation's output equals the recorded one, for the copy too."""
    table = replay(tmp_path, "--drafters", "retrieval,retrieval~")
    assert {("retrieval", "all"), ("retrieval~", "all")} <= set(table)
    assert table["retrieval~", "all"][0] > 3  # tokens per pass: it drafts from the repeats as the original does


def test_a_perfect_choice_sends_the_accepted_paths_first_n_nodes_or_the_path_whole_at_its_own_pass():
    from specedge.bench.replay import Oracle
    from specedge.common.cost_model import CostModel

    cost = CostModel(((0, 10.0), (4, 20.0), (12, 40.0)))  # 2.5 ms a node
    oracle = Oracle()
    oracle.add([0, 3, 10], cost)  # the accepted path's length in each round's tree
    assert oracle.tokens_per_pass(2) == pytest.approx(1 + (0 + 2 + 2) / 3)
    assert oracle.tokens_per_pass(16) == pytest.approx(1 + 13 / 3)
    # Plain decoding: 1 + 4 + 11 tokens at a 10 ms pass each; the paths alone: passes of 0, 3 and 10 nodes.
    assert oracle.plain_ms / oracle.path_ms == pytest.approx(160 / (10 + 17.5 + 35))
