"""The edge's choice of tree size on synthetic acceptance and cost models: trees grow with the round trip,
shrink as the verifier's load uses up the cheap part of its pass, never exceed the verifier's per-round cap,
and a fixed size (for experiments) is sent as asked; a second tree goes out ahead of the verdict in flight
when its expected tokens per millisecond beat waiting a round trip for that verdict."""

from __future__ import annotations

import pytest

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.edge.controller import MAX_IN_FLIGHT, TreeSizeController

LINEAR = CostModel(((0, 20.0), (64, 84.0)))  # a CPU-like pass: 20 ms plus 1 ms per draft token
# A GPU-like pass: flat while the step is small, then each token costs (the batch fills the device).
FLAT_THEN_LINEAR = CostModel(((0, 20.0), (32, 20.0), (256, 244.0)))
SLOW = CostModel(((0, 120.0), (64, 312.0)))  # a slow CPU's pass: 120 ms plus 3 ms per draft token


def chain(accept: float, n: int = 64) -> DraftTree:
    """A chain whose i-th node is accepted with probability accept**(i+1) (its path probability)."""
    return DraftTree(list(range(n)), list(range(-1, n - 1)), accept_probs=[accept ** (i + 1) for i in range(n)])


@pytest.mark.parametrize("accept", [0.6, 0.8, 0.9])
def test_trees_grow_as_the_round_trip_grows(accept):
    sizes = [TreeSizeController(max_nodes=64, overhead_ms=rtt).choose(chain(accept), LINEAR, remaining=1000)
             for rtt in (0, 20, 80, 150)]
    assert sizes == sorted(sizes), sizes
    assert sizes[-1] > sizes[0], sizes


def test_a_longer_measured_round_trip_moves_the_choice_the_same_way():
    controller = TreeSizeController(max_nodes=64)
    near = controller.choose(chain(0.85), LINEAR, remaining=1000)
    for _ in range(20):  # verdicts that took 100 ms more than the pass
        controller.observe(chain(0.85), StepResult([1], [], compute_ms=30.0, rtt_ms=100.0))
    assert controller.overhead_ms == pytest.approx(100.0, rel=0.01)
    assert controller.choose(chain(0.85), LINEAR, remaining=1000) > near


def test_trees_shrink_as_other_sessions_fill_the_verifiers_cheap_steps():
    controller = TreeSizeController(max_nodes=64)
    sizes = [controller.choose(chain(0.85), FLAT_THEN_LINEAR.at_load(other), remaining=1000)
             for other in (0, 8, 16, 24, 32)]
    # Alone, the step's free part is used whole; with others in it, less is free and each node must pay.
    # (Not strictly monotone: once nothing is free, a longer pass makes a node's cost relatively smaller.)
    assert sizes[0] >= 32 and all(s < sizes[0] for s in sizes[1:]), sizes
    assert sizes[1] >= 24 and sizes[2] >= 16, sizes


def test_the_cost_at_load_is_the_same_curve_shifted():
    for other in (0, 5, 16, 40, 300):
        shifted = FLAT_THEN_LINEAR.at_load(other)
        for n in range(0, 300, 7):
            assert shifted.ms(n) == pytest.approx(FLAT_THEN_LINEAR.ms(other + n)), (other, n)


def test_the_verifiers_per_round_cap_is_respected():
    controller = TreeSizeController(max_nodes=64, overhead_ms=150)
    assert controller.choose(chain(0.95), LINEAR, remaining=1000) > 5
    controller.observe(chain(0.95), StepResult([1], [], compute_ms=30.0, next_max_tree_tokens=5))
    assert controller.choose(chain(0.95), LINEAR, remaining=1000) <= 5
    fixed = TreeSizeController(max_nodes=64, fixed=32)
    fixed.observe(chain(0.95), StepResult([1], [], compute_ms=30.0, next_max_tree_tokens=5))
    assert fixed.choose(chain(0.95), LINEAR, remaining=1000) == 5


def test_a_fixed_size_is_sent_whatever_the_estimates_within_the_draft():
    controller = TreeSizeController(max_nodes=64, fixed=8)
    assert controller.choose(chain(0.1), LINEAR, remaining=1000) == 8  # the expected-value rule would send 0
    assert controller.choose(chain(0.99, n=5), LINEAR, remaining=1000) == 5  # a draft of 5 nodes has no more


def test_over_no_or_a_short_round_trip_the_edge_waits_for_the_verdict_instead_of_sending_ahead():
    """A tree drafted a verdict earlier is worth less, and waiting costs no more than a few ms here."""
    for accept in (0.5, 0.8, 0.95):
        assert TreeSizeController(max_nodes=16, overhead_ms=0).ahead(chain(accept), LINEAR, 1000, covered=6) is None
    without_fill = TreeSizeController(max_nodes=16, overhead_ms=5, fill=False)
    assert without_fill.ahead(chain(0.8), LINEAR, 1000, covered=9) is None
    assert TreeSizeController(max_nodes=16, overhead_ms=80, overlap=False).ahead(chain(0.85), LINEAR, 1000, 6) is None


@pytest.mark.parametrize("cost, pass_longer", [(LINEAR, False), (SLOW, True)],
                         ids=["pass-shorter-than-the-trip", "pass-longer-than-the-trip"])
def test_over_a_long_round_trip_a_tree_goes_out_ahead_holding_the_nodes_the_verdict_in_flight_may_commit(
        cost, pass_longer):
    """Waiting leaves the verifier idle for a round trip per verdict; a tree ahead costs a pass. That pays even
    where the pass is longer than the trip (a slow CPU verifier: 120 ms and more against 80)."""
    controller = TreeSizeController(max_nodes=16, overhead_ms=80)
    covered = controller.choose(chain(0.7), cost, remaining=1000)
    assert (cost.ms(covered) > 80) == pass_longer  # the case this run stands for
    size = controller.ahead(chain(0.7), cost, remaining=1000, covered=covered)
    assert size is not None and size >= covered


def test_a_tree_ahead_is_priced_by_the_nodes_below_what_the_verdict_in_flight_can_commit():
    """Only nodes below the covered ones add tokens (a child of a covered node would be that verdict's bonus
    token): a draft with nothing deep is sent ahead only as the bare pass's one token, if at all, and a
    draft with more below goes out with more nodes."""
    far = TreeSizeController(max_nodes=16, overhead_ms=80)
    star = DraftTree(list(range(12)), [-1] * 12, accept_probs=[0.05] * 12)  # 12 alternatives for one token
    assert far.ahead(star, LINEAR, remaining=1000, covered=6) == 6  # the pass's own token alone pays
    deep = far.ahead(chain(0.95), LINEAR, remaining=1000, covered=6)
    assert deep is not None and deep > 7
    assert far.ahead(chain(0.95, n=10), LINEAR, remaining=1000, covered=6) <= 10  # no more than the draft


@pytest.mark.parametrize("accept", [0.5, 0.8])
def test_where_the_verifier_drafts_for_a_tree_with_nothing_left_a_shorter_round_trip_pays_for_going_ahead(accept):
    """A bare tree ahead is worth what the verifier drafts for it once it knows the verdict before it, taken
    to be what the edge's draft promises: ahead then pays wherever a round trip is worth AHEAD_MARGIN of a
    pass, and not over a round trip of a few ms; a fixed size lets the verifier draft that many tokens."""
    for rtt in (20, 40):
        assert TreeSizeController(max_nodes=16, overhead_ms=rtt, fill=False).ahead(
            chain(accept), SLOW, 1000, covered=9) is None, rtt
        assert TreeSizeController(max_nodes=16, overhead_ms=rtt).ahead(chain(accept), SLOW, 1000, covered=9), rtt
    assert TreeSizeController(max_nodes=16, overhead_ms=2).ahead(chain(accept), SLOW, 1000, covered=9) is None
    assert TreeSizeController(max_nodes=16).fill_tokens == 16
    assert TreeSizeController(max_nodes=16, fixed=8).fill_tokens == 8
    assert TreeSizeController(max_nodes=16, fill=False).fill_tokens == 0


@pytest.mark.parametrize("committed, goes_ahead", [(0, False), (None, True)], ids=["nothing", "as-promised"])
def test_the_worth_of_the_verifiers_drafts_follows_what_they_have_committed(committed, goes_ahead):
    """Under load the verifier sizes its drafts down, and in a new session its estimates start from priors: a
    bare tree ahead is worth what its drafts have lately committed against what the edge's drafts promised."""
    controller = TreeSizeController(max_nodes=16, overhead_ms=40)
    draft = chain(0.8)
    promised = sum(draft.accept_probs[: controller.choose(draft, SLOW, 1000)])
    for _ in range(40):
        assert controller.ahead(draft, SLOW, 1000, covered=9) is not None or not goes_ahead
        drafted = round(promised) if committed is None else committed
        controller.observe(DraftTree.empty(), StepResult([1] * (drafted + 1), [], compute_ms=120.0,
                                                         verifier_drafted=drafted), ahead=True)
    assert (controller.ahead(draft, SLOW, 1000, covered=9) is not None) == goes_ahead


@pytest.mark.parametrize("verified, goes_ahead", [(None, True), ("as-sent", True), (64, False)],
                         ids=["not-reported", "as-waiting-sends", "a-large-draft"])
def test_a_bare_tree_ahead_is_priced_by_the_pass_of_what_the_verifier_lately_drafted_for_one(verified, goes_ahead):
    """The verifier's own draft for a bare tree is its pass's nodes: a draft that commits what the edge's would
    but verifies six times the nodes costs that pass, and waiting for the verdict pays then."""
    controller = TreeSizeController(max_nodes=64, overhead_ms=40)
    draft = chain(0.8)
    sent = controller.choose(draft, SLOW, 1000)
    promised = round(sum(draft.accept_probs[:sent]))
    nodes = sent if verified == "as-sent" else verified
    for _ in range(40):
        controller.observe(DraftTree.empty(), StepResult([1] * (promised + 1), [], compute_ms=120.0,
                                                         verifier_drafted=promised, verified_nodes=nodes), ahead=True)
    assert (controller.ahead(draft, SLOW, 1000, covered=9) is not None) == goes_ahead


def beyond_path(path: list[float], below: float, n: int = 12) -> DraftTree:
    """The tree in flight's likeliest path (these path probabilities) as a chain, with a draft of n tokens
    below its end, each accepted with probability `below` given the one before."""
    probs = path + [path[-1] * below ** (i + 1) for i in range(n)]
    return DraftTree(list(range(len(probs))), list(range(-1, len(probs) - 1)), accept_probs=probs)


def test_a_draft_beyond_the_likeliest_path_in_flight_goes_ahead_when_that_path_is_likely():
    """A model drafter drafts beyond the in-flight tree's likeliest path, which it sends as a chain with its
    draft below: the draft's nodes add tokens where the verdict in flight commits that path whole. Waiting is
    priced on the draft below the path, as one drafted after the verdict would start from about there. A likely
    path with a confident draft below goes ahead with the draft; an unlikely one waits for the verdict."""
    far = TreeSizeController(max_nodes=16, overhead_ms=80, fill=False)
    likely = far.ahead(beyond_path([0.98, 0.96, 0.94, 0.92], 0.9), LINEAR, 1000, covered=4, beyond=True)
    assert likely is not None and likely > 4 + 6
    assert far.ahead(beyond_path([0.6, 0.35, 0.2, 0.1], 0.9), LINEAR, 1000, covered=4, beyond=True) is None


@pytest.mark.parametrize("drafted, goes_ahead", [(0, False), (2, True)])
def test_a_draft_beyond_a_path_is_worth_its_nodes_where_the_path_is_committed_and_the_verifiers_where_not(
        drafted, goes_ahead):
    """Beyond a path nothing of the tree is left where the verdict in flight does not commit the path whole,
    and there the verifier drafts: the tree ahead is worth both. Priced as one or the other, this one
    waited even where the verifier's drafts commit two tokens a bare tree ahead."""
    draft = beyond_path([0.9, 0.7, 0.5, 0.4], 0.9)
    far = TreeSizeController(max_nodes=16, overhead_ms=80)
    for _ in range(20):
        far.ahead(draft, LINEAR, 1000, covered=4, beyond=True)
        far.observe(DraftTree.empty(), StepResult([1] * (drafted + 1), [], compute_ms=150.0,
                                                  verifier_drafted=drafted), ahead=True)
    assert (far.ahead(draft, LINEAR, 1000, covered=4, beyond=True) is not None) == goes_ahead


def test_a_fixed_size_goes_ahead_with_that_many_nodes_below_the_covered_ones():
    fixed = TreeSizeController(max_nodes=64, overhead_ms=80, fixed=8)
    assert fixed.ahead(chain(0.95), LINEAR, remaining=1000, covered=6) == 6 + 8


def test_a_tree_sent_ahead_tells_nothing_of_the_round_trip():
    controller = TreeSizeController(overhead_ms=80)
    controller.observe(chain(0.9), StepResult([1], [], compute_ms=30.0, rtt_ms=0.0), ahead=True)
    assert controller.overhead_ms == 80  # it waited on the verifier for the verdict before it
    controller.observe(chain(0.9), StepResult([1], [], compute_ms=30.0, rtt_ms=0.0))
    assert controller.overhead_ms < 80


def test_the_drafting_of_a_tree_sent_after_its_verdict_is_part_of_the_rounds_overhead_and_can_send_trees_ahead():
    """The verifier waits through the edge's drafting after a verdict as through the network: on a GPU's pass of a
    few milliseconds, a millisecond of drafting a round makes a bare tree ahead (drafted by the verifier, knowing
    the verdict) pay over no round trip at all; without it counted, the edge waits. A tree sent ahead was drafted
    while the verifier was busy: its drafting costs the verifier nothing."""
    gpu = CostModel(((0, 3.0), (64, 3.5)))
    draft = chain(0.7)
    counted, uncounted = TreeSizeController(max_nodes=16), TreeSizeController(max_nodes=16)
    for _ in range(20):
        for controller, draft_ms in ((counted, 1.2), (uncounted, 0.0)):
            controller.choose(draft, gpu, 1000)
            controller.observe(draft.prefix(8), StepResult([1, 2, 3], [0, 1], compute_ms=3.0, rtt_ms=0.0),
                               draft_ms=draft_ms)
            controller.observe(DraftTree.empty(), StepResult([1, 2, 3], [], compute_ms=3.0, verifier_drafted=2),
                               ahead=True, draft_ms=5.0)
    assert counted.overhead_ms == pytest.approx(1.2, rel=0.01) and uncounted.overhead_ms == pytest.approx(0.0)
    assert counted.ahead(draft, gpu, 1000, covered=0) is not None
    assert uncounted.ahead(draft, gpu, 1000, covered=0) is None


@pytest.mark.parametrize("committed, waits", [("nothing", False), ("as-priced", True)])
def test_the_price_of_waiting_follows_what_the_trees_sent_after_waits_committed(committed, waits):
    """Waiting is priced by a draft made before the verdict awaited, and the draft after that verdict may
    promise less (a model drafter's nodes, computed beyond where the verdict was thought to end, are gone
    once the verifier's own draft has moved the end on). Where the trees sent after waits commit nothing,
    the edge stops waiting; where they commit what waiting was priced at, it goes on waiting."""
    draft = beyond_path([0.6, 0.35, 0.2, 0.1], 0.9)
    fresh = draft.after(draft.tokens[:4])  # what waiting is priced by, and here what is drafted after a wait
    far = TreeSizeController(max_nodes=16, overhead_ms=80, fill=False)
    for _ in range(40):
        if far.ahead(draft, LINEAR, 1000, covered=4, beyond=True) is None:
            sent = fresh.prefix(far.choose(fresh, LINEAR, 1000))
            accepted = list(range(round(sum(sent.accept_probs)))) if committed == "as-priced" else []
            far.observe(sent, StepResult([1] * (len(accepted) + 1), accepted, compute_ms=30.0, rtt_ms=80.0))
    assert (far.ahead(draft, LINEAR, 1000, covered=4, beyond=True) is None) == waits


def _waits_that_commit_nothing(controller: TreeSizeController, draft: DraftTree, covered: int,
                               cost: CostModel = LINEAR) -> None:
    """Every wait the controller decides is followed by a tree that commits nothing."""
    fresh = draft.after(draft.tokens[:covered])
    for _ in range(40):
        if controller.ahead(draft, cost, 1000, covered=covered, beyond=True) is None:
            sent = fresh.prefix(controller.choose(fresh, cost, 1000))
            controller.observe(sent, StepResult([1], [], compute_ms=20.0, rtt_ms=0.0))


@pytest.mark.parametrize("fill", [False, True])
def test_a_draft_beyond_a_path_is_worth_no_more_ahead_than_the_draft_after_the_verdict_committed(fill):
    """A draft beyond a path is made a verdict before the one drafted after a wait, which knows more. Where the
    trees sent after waits commit nothing of what waiting was priced at, the nodes below the path are worth
    nothing ahead either: at 0 ms none of them go (at most the path, for the verifier to draft below)."""
    draft = beyond_path([0.98, 0.96, 0.94, 0.92], 0.9)
    near = TreeSizeController(max_nodes=16, overhead_ms=0.5, fill=fill)
    _waits_that_commit_nothing(near, draft, covered=4)
    assert near.ahead(draft, LINEAR, 1000, covered=4, beyond=True) in (None, 4)


def test_before_the_verifiers_draft_is_measured_a_bare_tree_ahead_is_priced_as_a_wait():
    """The verifier drafts from the same text as the edge's draft after a wait: until what its drafts commit is
    measured, they are priced as the waits' drafts lately committed. Where those commit nothing, the edge goes on
    waiting at 0 ms; once the verifier's drafts are measured to commit two tokens a bare tree, it goes ahead. (On a
    pass as long with a few nodes as with none, so that only what the trees are worth decides.)"""
    draft = beyond_path([0.9, 0.8, 0.7, 0.6], 0.3)
    near = TreeSizeController(max_nodes=16, overhead_ms=0.5)
    _waits_that_commit_nothing(near, draft, covered=4, cost=FLAT_THEN_LINEAR)
    assert near.ahead(draft, FLAT_THEN_LINEAR, 1000, covered=4, beyond=True) is None
    for _ in range(10):
        near.observe(DraftTree.empty(), StepResult([1, 2, 3], [], compute_ms=20.0, verifier_drafted=2), ahead=True)
    assert near.ahead(draft, FLAT_THEN_LINEAR, 1000, covered=4, beyond=True) is not None


def test_a_wait_decided_as_a_generation_ends_prices_nothing_in_the_next():
    """Where a generation's last verdict comes after a wait was decided, no tree follows that wait. The next
    generation's first tree (the prompt's pass, which commits no draft) is not what that wait was worth."""
    draft = beyond_path([0.6, 0.35, 0.2, 0.1], 0.9)
    fresh = draft.after(draft.tokens[:4])
    far = TreeSizeController(max_nodes=16, overhead_ms=80, fill=False)
    for _ in range(40):
        far.begin()
        first = fresh.prefix(far.choose(fresh, LINEAR, 1000))
        far.observe(first, StepResult([1], [], compute_ms=30.0, rtt_ms=80.0))
        assert far.ahead(draft, LINEAR, 1000, covered=4, beyond=True) is None  # and the generation ends


def test_a_fresh_drafts_waits_are_priced_by_its_draft_whatever_they_committed():
    """The scale is for drafts beyond a path, whose nodes may be gone after the wait. A fresh draft from the
    committed text (retrieval's) keeps waiting at 0 ms, where a tree drafted a verdict early never pays."""
    controller = TreeSizeController(max_nodes=16, overhead_ms=0)
    for _ in range(40):
        assert controller.ahead(chain(0.8), LINEAR, 1000, covered=6) is None
        sent = chain(0.8).prefix(controller.choose(chain(0.8), LINEAR, 1000))
        controller.observe(sent, StepResult([1], [], compute_ms=30.0, rtt_ms=0.0))


def test_waits_priced_at_nothing_teach_nothing_about_the_price_of_waiting():
    """A draft with nothing below the path in flight prices waiting at nothing; where the tree after such a
    wait commits nothing too, that says nothing of what waiting is worth. At 0 ms the edge goes on waiting
    for a confident draft afterwards, as a new controller does (scaled to nothing, it went ahead)."""
    bare_path = beyond_path([0.9, 0.8, 0.7, 0.6], 0.9, n=0)
    confident = beyond_path([0.98, 0.96, 0.94, 0.92], 0.95)
    near = TreeSizeController(max_nodes=16, overhead_ms=0, fill=False)
    assert near.ahead(confident, LINEAR, 1000, covered=4, beyond=True) is None
    for _ in range(20):
        assert near.ahead(bare_path, LINEAR, 1000, covered=4, beyond=True) is None
        near.choose(DraftTree.empty(), LINEAR, 1000)
        near.observe(DraftTree.empty(), StepResult([1], [], compute_ms=20.0, rtt_ms=0.0))
    assert near.ahead(confident, LINEAR, 1000, covered=4, beyond=True) is None


def test_as_many_trees_stay_in_flight_as_passes_fit_in_a_round_trip():
    """Two (the one awaited and one ahead) where a pass is about as long as the round trip, as on a CPU; many
    where the pass is a few milliseconds and the round trip tens, as with a GPU far away; at most
    MAX_IN_FLIGHT; two without the verifier's drafts, as trees beyond the second go bare."""
    gpu = CostModel(((0, 3.0), (64, 3.5)))
    assert [TreeSizeController(overhead_ms=rtt).depth(LINEAR) for rtt in (0, 20, 80)] == [2, 2, 5]
    assert [TreeSizeController(overhead_ms=rtt).depth(gpu) for rtt in (0, 20, 80)] == [2, 8, 28]
    assert TreeSizeController(overhead_ms=10_000).depth(gpu) == MAX_IN_FLIGHT
    assert TreeSizeController(overhead_ms=80, fill=False).depth(gpu) == 2
    assert TreeSizeController(overhead_ms=80, max_in_flight=3).depth(gpu) == 3


def test_a_tree_beyond_the_second_sends_the_nodes_below_its_path_only_where_they_beat_the_verifiers_draft():
    """Beyond the second tree in flight a verdict comes every pass, so the nodes below the likeliest path through
    the trees before are priced by their pass alone, against the same tree with none of them, which the verifier
    drafts for itself: a likely path with a confident draft below sends it, an unlikely path sends none (but a
    fixed size's nodes), nor does a draft that covers no path (the verdicts before it commit what it could not
    know), and the better the verifier's own drafts have lately been, the fewer nodes of a middling draft go."""
    gpu = CostModel(((0, 3.0), (64, 3.5)))
    far = TreeSizeController(max_nodes=16, overhead_ms=80)
    assert far.deeper(beyond_path([0.98, 0.96, 0.94, 0.92], 0.9), gpu, 1000, covered=4) > 4 + 6
    assert far.deeper(beyond_path([0.2, 0.05, 0.02, 0.01], 0.5), gpu, 1000, covered=4) == 4
    fixed = TreeSizeController(max_nodes=16, overhead_ms=80, fixed=3)  # (a fixed size is sent whatever it promises)
    assert fixed.deeper(beyond_path([0.2, 0.05, 0.02, 0.01], 0.5), gpu, 1000, covered=4) == 4 + 3
    assert far.deeper(beyond_path([0.98], 0.9), gpu, 1000, covered=0) == 0
    middling = beyond_path([0.9, 0.8], 0.7)
    before = far.deeper(middling, gpu, 1000, covered=2)
    for _ in range(40):
        far.observe(DraftTree.empty(), StepResult([1] * 5, [], compute_ms=3.0, verifier_drafted=4), ahead=True)
    assert 2 <= far.deeper(middling, gpu, 1000, covered=2) < before
