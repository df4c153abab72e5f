"""When the hybrid's model speculates during a pass: in every pass while it warms up and while the tokens only
it drafted are at least GAIN_MIN of what the rounds commit; below that, in one pass of PROBE, reading the
committed text in the pass before and resting in the others, and it takes part in one generation of PROBE
whose prompt is longer than LONG_PROMPT."""

from specedge.edge.model_worth import GAIN_MIN, LONG_PROMPT, PROBE, WARM_UP, ModelWorth, PassWork

SPECULATE, READ, REST = PassWork.SPECULATE, PassWork.READ, PassWork.REST


def test_it_speculates_in_every_pass_while_warming_up():
    worth = ModelWorth()
    for _ in range(WARM_UP - 1):
        assert worth.this_pass() is SPECULATE
        worth.record(0, 3)
    assert worth.this_pass() is SPECULATE


def test_it_keeps_speculating_while_the_model_earns_its_share():
    worth = ModelWorth()
    for _ in range(3 * WARM_UP):
        worth.record(1, 10)  # 10% of the tokens: the model's alone
        assert worth.share >= GAIN_MIN
        assert worth.this_pass() is SPECULATE


def test_below_its_share_it_probes_once_in_a_few_passes_and_comes_back_when_the_model_helps_again():
    worth = ModelWorth()
    for _ in range(WARM_UP):
        worth.record(0, 3)
    assert [worth.this_pass() for _ in range(2 * PROBE)] == ([REST] * (PROBE - 2) + [READ, SPECULATE]) * 2
    worth.record(2, 3)  # the probe's tree: two of its three tokens were the model's alone
    assert [worth.this_pass() for _ in range(PROBE)] == [SPECULATE] * PROBE


def test_the_share_is_a_moving_average_of_recent_rounds():
    worth = ModelWorth()
    for _ in range(WARM_UP):
        worth.record(3, 4)
    assert worth.share == 0.75  # the plain mean at first
    for _ in range(60):
        worth.record(0, 4)
    assert worth.share < 0.01  # what the model drafted long ago no longer counts


def test_below_its_share_it_takes_part_in_one_long_prompt_of_a_few_and_in_every_short_one():
    worth = ModelWorth()
    assert worth.takes_part(LONG_PROMPT + 1)  # warming up
    for _ in range(WARM_UP):
        worth.record(0, 3)
    assert [worth.takes_part(LONG_PROMPT + 1) for _ in range(2 * PROBE)] == ([False] * (PROBE - 1) + [True]) * 2
    assert all(worth.takes_part(LONG_PROMPT) for _ in range(PROBE))
    worth.record(3, 3)
    assert all(worth.takes_part(LONG_PROMPT + 1) for _ in range(PROBE))
