"""When the hybrid's model speculates during a pass: in every pass until what its forwards cost is measured,
and after that while the tokens only it drafted are at least the share by which its forwards slow the
verifier's passes beside them; below that, in one pass of PROBE and then ever fewer, reading the committed
text in the pass before and resting in the others (and while it speculates in every pass, it rests in one of
REMEASURE, so that what its forwards cost is measured and stays so); below its share it takes part in one
generation of PROBE, and in ever fewer. Where its forwards cost the passes nothing, so do probes: it backs
off from neither."""

import pytest

from specedge.edge.model_worth import (COSTED, FRESH, GAIN_FLOOR, PROBE, PROBE_MOST, REMEASURE,
                                       WARM_UP, WEIGHT, ModelWorth, PassWork)

SPECULATE, READ, REST = PassWork.SPECULATE, PassWork.READ, PassWork.REST


def test_until_its_cost_is_measured_it_speculates_in_every_pass_but_one_whatever_its_share():
    """Its share is judged against what its forwards cost: before that was measured, judged against a fixed 5%,
    a model worth its forwards on separate machines had sat out for good, its cost never measured
    (BENCHMARKS.md section 6, "The model's cost was never measured")."""
    worth = ModelWorth()
    work = []
    while worth.costed < COSTED:
        work.append(worth.this_pass())
        worth.record(0, 3)  # none of the model's tokens accepted
        worth.passed(3, 110.0 if work[-1] is SPECULATE else 100.0, work[-1])
    assert work.count(REST) == len(work) // REMEASURE and len(work) > WARM_UP
    assert set(work) == {SPECULATE, REST}
    assert worth.gain_min == pytest.approx(0.10) and not worth.earning
    assert worth.this_pass() is REST


def test_while_the_model_earns_its_share_it_speculates_in_every_pass_but_one_in_which_its_cost_is_measured():
    """Resting in one pass of REMEASURE, the model leaves passes alone to compare those beside it with; without
    them its cost would go unmeasured just where it runs the most forwards."""
    worth = measured(100.0)  # its forwards cost the passes nothing: GAIN_FLOOR
    work = []
    for _ in range(3 * REMEASURE):
        worth.record(1, 10)  # 10% of the tokens: the model's alone
        assert worth.earning
        work.append(worth.this_pass())
    assert work == ([SPECULATE] * (REMEASURE - 1) + [REST]) * 3


def probes(every: int) -> list[PassWork]:
    return [REST] * (every - 2) + [READ, SPECULATE]


def test_below_its_share_it_probes_ever_more_rarely_and_comes_back_when_the_model_helps_again():
    """Once in PROBE passes, then in twice as many after each probe that leaves it below its share, up to
    PROBE_MOST: a probe costs the pass beside it what any speculation does, and one that finds the model's
    tokens (the share is a moving average over speculated rounds) brings it back at once."""
    worth = measured(102.0)  # its forwards cost the passes 2%; none of its tokens accepted in its warm-up
    waits = [PROBE * 2**k for k in range(8) if PROBE * 2**k <= PROBE_MOST]
    assert waits[0] == PROBE and waits[-1] == PROBE_MOST and len(waits) > 2
    assert [worth.this_pass() for _ in range(sum(waits) + PROBE_MOST)] == sum(map(probes, waits + [PROBE_MOST]), [])
    worth.record(2, 3)  # the probe's tree: two of its three tokens were the model's alone
    assert [worth.this_pass() for _ in range(PROBE)] == [SPECULATE] * PROBE
    for _ in range(round(3 / WEIGHT)):
        worth.record(0, 3)
    assert [worth.this_pass() for _ in range(2 * PROBE)] == probes(PROBE) + probes(2 * PROBE)[: PROBE]


def test_the_share_is_a_moving_average_of_recent_rounds():
    worth = ModelWorth()
    for _ in range(WARM_UP):
        worth.record(3, 4)
    assert worth.share == 0.75  # the plain mean at first
    for _ in range(round(5 / WEIGHT)):
        worth.record(0, 4)
    assert worth.share < 0.01  # what the model drafted long ago no longer counts


def test_a_dry_spell_of_ten_rounds_does_not_sit_out_a_model_that_drafts_its_share_in_bursts():
    """Its own tokens come a few at once in a few rounds of many: judged over ten rounds, a model that drafted
    3.5-6% of the tokens alone had sat out for good after one dry spell (BENCHMARKS.md section 6)."""
    worth = measured(100.0)  # separate machines: GAIN_FLOOR
    for n in range(round(2 / WEIGHT)):
        worth.record(3 if n % 25 == 0 else 0, 3)  # 3 tokens of its own in one round of 25: 4%
    for _ in range(10):
        worth.record(0, 3)
    assert worth.earning
    for _ in range(round(3 / WEIGHT)):
        worth.record(0, 3)
    assert not worth.earning  # a longer drought does


def takes_part_in(every: int) -> list[bool]:
    return [False] * (every - 1) + [True]


def test_below_its_share_it_takes_part_in_ever_fewer_generations_and_in_all_once_the_model_helps():
    """Taking part means reading the prompt first: forwards beside the verifier's prefill and first passes.
    Below its share it takes part in one generation of PROBE, then, after each that leaves it below, in
    twice as few, up to PROBE_MOST (as it probes passes)."""
    assert ModelWorth().takes_part()  # warming up
    worth = measured(102.0)  # none of its tokens accepted in its warm-up
    waits = [PROBE * 2**k for k in range(8) if PROBE * 2**k <= PROBE_MOST]
    expected = sum(map(takes_part_in, waits + [PROBE_MOST]), [])
    assert [worth.takes_part() for _ in range(len(expected))] == expected
    worth.record(3, 3)
    assert all(worth.takes_part() for _ in range(PROBE))
    for _ in range(round(3 / WEIGHT)):
        worth.record(0, 3)
    assert [worth.takes_part() for _ in range(PROBE)] == takes_part_in(PROBE)  # the back-off starts again


def test_where_its_forwards_cost_the_passes_nothing_it_probes_without_backing_off_and_takes_part_in_all():
    """On separate machines a probe costs the verifier nothing: backing off there, the model had stayed out of
    the categories after one where it drafts next to nothing, losing the 9-10% it gains in them (BENCHMARKS.md
    section 6, "Where watching is free")."""
    worth = measured(100.0)  # none of its tokens accepted in its warm-up
    assert worth.probes_free and not worth.earning
    assert [worth.this_pass() for _ in range(5 * PROBE)] == probes(PROBE) * 5
    assert all(worth.takes_part() for _ in range(PROBE_MOST))
    assert not measured(102.0).probes_free  # a cost of 2% is not nothing
    unmeasured = ModelWorth()
    assert not unmeasured.probes_free  # nor is a cost never measured


def measured(pass_ms_beside_speculation: float) -> ModelWorth:
    """A ModelWorth past its warm-up whose passes took 100 ms at 3 nodes alone (and 200 at 8), and the given
    time at 3 nodes beside the model's speculation."""
    worth = ModelWorth()
    for _ in range(WARM_UP):
        worth.record(0, 3)
    for _ in range(2 * COSTED):
        worth.passed(3, 100.0, PassWork.REST)
        worth.passed(8, 200.0, None)  # the model took no part: a pass alone too
        worth.passed(3, 900.0, PassWork.READ)  # a read beside it: neither
        worth.passed(3, pass_ms_beside_speculation, PassWork.SPECULATE)
    return worth


def test_the_share_it_must_draft_is_what_its_forwards_cost_the_passes_beside_them():
    assert measured(110.0).gain_min == pytest.approx(0.10)  # beside the verifier on one host: passes 10% slower
    assert measured(100.0).gain_min == GAIN_FLOOR  # separate machines: its forwards cost the verifier nothing
    for share in (0.03, 0.08):
        worth = measured(100.0)
        for _ in range(WARM_UP):
            worth.record(round(share * 100), 100)
        assert worth.this_pass() is SPECULATE  # 3% of the tokens pay for forwards that cost nothing
    worth = measured(110.0)
    for _ in range(WARM_UP):
        worth.record(8, 100)
    assert [worth.this_pass() for _ in range(PROBE)] == [REST] * (PROBE - 2) + [READ, SPECULATE]  # 8% < 10%


def test_passes_beside_its_speculation_are_compared_with_recent_passes_of_their_own_tree_size():
    worth = ModelWorth()
    for _ in range(2 * COSTED):
        worth.passed(3, 100.0, PassWork.REST)
        worth.passed(8, 200.0, PassWork.SPECULATE)  # no pass of 8 nodes alone: nothing to compare it with
    assert worth.costed == 0 and worth.earning
    worth.passed(8, 190.0, PassWork.REST)
    worth.passed(8, 209.0, PassWork.SPECULATE)
    assert worth.costed == 1 and worth.cost == pytest.approx(0.10)
    for _ in range(FRESH):  # while it earns its share it speculates in all but one pass of REMEASURE
        worth.passed(8, 209.0, PassWork.SPECULATE)
    assert worth.costed == FRESH  # by the last of them, the pass alone is FRESH passes old
    worth.passed(8, 400.0, PassWork.SPECULATE)  # the context has grown since: too old to compare with
    assert worth.costed == FRESH and worth.cost == pytest.approx(0.10)


def test_passes_alone_of_an_earlier_generation_are_not_compared_with():
    """A pass's time grows with the context: one alone over a long prompt would make the model's forwards beside
    a short prompt's passes look free."""
    worth = ModelWorth()
    worth.passed(3, 300.0, PassWork.REST)  # a long prompt's pass
    worth.begin()
    worth.passed(3, 110.0, PassWork.SPECULATE)
    assert worth.costed == 0
    worth.passed(3, 100.0, PassWork.REST)
    worth.passed(3, 110.0, PassWork.SPECULATE)
    assert worth.costed == 1 and worth.cost == pytest.approx(0.10)
