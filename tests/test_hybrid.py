"""The hybrid drafter's merge: two best-first drafts become one trie ordered by estimate, each source learns
from its own sent nodes, and a model proposal survives only where a node's children are the model's draws.
The model's part of every tree is what it computed during the pass before, and it is asked for nothing else.
The sources here are small scripted drafters (the real ones need a model: test_greedy_equality.py runs the
hybrid end to end)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.generation import generate
from specedge.edge.hybrid import HybridDrafter
from specedge.edge.model_worth import COSTED, PROBE, REMEASURE, WARM_UP


class Scripted:
    """A drafter that proposes a fixed tree and records what it is told."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self.observed: list[tuple[DraftTree, StepResult]] = []
        self.proposed = 0
        self.known_only: list[bool] = []  # each draft's `known_only`
        self.read_aheads: list[list[int]] = []  # what each speculation was told the verdict likely commits
        self.steps: list[int | None] = []  # each speculation's most forwards (None: the model's default)

    def begin(self, prompt_ids, params=None, read: bool = True) -> None:
        self.begun = getattr(self, "begun", 0) + 1

    def propose(self, known_only: bool = False) -> DraftTree:
        self.proposed += 1
        self.known_only.append(known_only)
        return self.tree

    def propose_after(self, path: list[int], known_only: bool = False) -> DraftTree:
        return self.propose(known_only)

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        self.observed.append((tree, result))

    def learn(self) -> None:
        pass

    def end(self) -> None:
        pass

    def speculate(self, stop, steps=None, then=()) -> None:
        self.read_aheads.append(list(then))
        self.steps.append(steps)


def paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)): tree.accept_probs[i] for i in range(len(tree))}


# Retrieval: 10 -> 11 -> 12 (confident), and 20. Model: 10 -> 13 (its own continuation), and 30.
RETRIEVAL = DraftTree([10, 11, 12, 20], [-1, 0, 1, -1], accept_probs=[0.9, 0.8, 0.7, 0.2])
MODEL = DraftTree([10, 13, 30], [-1, 0, -1], accept_probs=[0.95, 0.5, 0.1])


def cost_measured(hybrid: HybridDrafter, cost: float = 0.0) -> HybridDrafter:
    """As once what the model's forwards cost the verifier's passes is measured (until then it speculates as if
    it earned its share, edge/model_worth.py): `cost` 0 as on separate machines."""
    hybrid.worth.costed, hybrid.worth.cost = COSTED, cost
    return hybrid


def after_a_speculation(hybrid: HybridDrafter) -> HybridDrafter:
    """As after a pass the model speculated in: the next tree takes the model's part (what it computed then)."""
    hybrid._speculated = True
    return hybrid


def test_shared_paths_merge_and_nodes_come_best_first():
    hybrid = HybridDrafter(Scripted(RETRIEVAL), Scripted(MODEL), max_nodes=64)
    hybrid.begin([1, 2])
    tree = after_a_speculation(hybrid).propose()
    tree.validate(100)
    assert paths(tree) == {(10,): 0.95, (10, 11): 0.8, (10, 11, 12): 0.7, (10, 13): 0.5, (20,): 0.2, (30,): 0.1}
    assert tree.accept_probs == sorted(tree.accept_probs, reverse=True)
    assert tree.proposals is None


def test_the_node_budget_keeps_the_best_nodes():
    hybrid = HybridDrafter(Scripted(RETRIEVAL), Scripted(MODEL), max_nodes=3)
    hybrid.begin([1])
    assert set(paths(after_a_speculation(hybrid).propose())) == {(10,), (10, 11), (10, 11, 12)}


def test_each_source_hears_about_the_nodes_of_its_own_that_were_sent():
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    tree = after_a_speculation(hybrid).propose().prefix(4)  # the controller sent 10, 10-11, 10-11-12, 10-13
    first, second = tree.path_to(tree.tokens.index(11))  # the verifier accepted 10 and 11, then said 99
    hybrid.observe(tree, StepResult(tokens=[10, 11, 99], accepted=[first, second], compute_ms=5.0))
    (r_tree, r_result), = retrieval.observed
    assert r_tree.tokens == [10, 11, 12] and r_result.accepted == [0, 1] and r_result.tokens == [10, 11, 99]
    (m_tree, m_result), = model.observed
    assert m_tree.tokens == [10, 13] and m_result.accepted == [0] and m_result.compute_ms == 5.0


def test_a_model_proposal_survives_only_where_retrieval_proposes_nothing():
    """Which rule checks a node's children must not depend on what the model drew there, so it is decided
    from the retrieval draft alone: where retrieval has children, every child is a deterministic candidate."""
    q_root, q_after_10, q_after_13 = ([10, 30, 40], [0.6, 0.3, 0.1]), ([13, 14], [0.7, 0.3]), ([15], [1.0])
    sampled = DraftTree([10, 13, 30, 15], [-1, 0, -1, 1], proposals={-1: q_root, 0: q_after_10, 1: q_after_13},
                        accept_probs=[0.6, 0.4, 0.2, 0.3])
    retrieval = DraftTree([10, 11], [-1, 0], accept_probs=[0.5, 0.45])  # children at the root and under 10
    hybrid = HybridDrafter(Scripted(retrieval), Scripted(sampled), max_nodes=64)
    hybrid.begin([1])
    tree = after_a_speculation(hybrid).propose()
    tree.validate(100)
    assert tree.proposals == {tree.tokens.index(13): q_after_13}
    under_ten = [tree.tokens[c] for c in tree.children()[tree.tokens.index(10) + 1]]
    assert sorted(under_ten) == [11, 13]
    # The same draws without retrieval's candidates: every proposal stands.
    alone = HybridDrafter(Scripted(DraftTree.empty()), Scripted(sampled), max_nodes=64)
    alone.begin([1])
    assert len(after_a_speculation(alone).propose().proposals) == 3


MODEL_ADDS = DraftTree([10, 13, 14, 15], [-1, 0, 1, 2], accept_probs=[0.95, 0.5, 0.4, 0.3])  # 13-14-15: its own
# Retrieval that drafts 10-11-12 beyond the path 10-11-12-99 too
REPEATING = DraftTree([10, 11, 12, 99, 10, 11, 12], list(range(-1, 6)), accept_probs=[0.9] * 7)


def test_every_tree_serial_or_ahead_takes_only_what_the_model_computed_during_the_pass_before():
    """The model is asked for its part of a tree only from what it computed while the verifier checked the
    tree before (`known_only`): drafting after the verdict would keep a serial round's tree from the verifier
    (at 0 ms, every ms of it idle) and make a tree ahead late (BENCHMARKS.md section 8). Its nodes are in
    every tree drafted after a pass, serial rounds' and trees ahead, and the verifier commits them."""
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL_ADDS)
    hybrid = cost_measured(HybridDrafter(retrieval, model, max_nodes=64))
    hybrid.begin([1])
    take = (10, 13, 14, 15)
    trees = [serial_round(hybrid, take) for _ in range(5)] + pipelined_rounds(hybrid, 5, take)
    # Not in the first tree, nor in the first tree ahead, drafted just after the tree before it: no pass between
    computed = [False] + [True] * 4 + [True, False] + [True] * 4
    assert [13 in tree.tokens for tree in trees] == computed
    assert model.known_only == [True] * sum(computed) and retrieval.proposed == len(trees)
    assert {len(result.accepted) for tree, result in model.observed if len(tree)} == {4}


def test_during_each_pass_the_model_reads_the_likely_verdict_and_computes_beyond_it():
    """What the model computes during a serial round's pass starts after the merged tree's likeliest path as
    far as it is more likely accepted than not (retrieval's 10-11-12 here, estimated 0.9, 0.8, 0.7, against
    the model's 10-13 at 0.5); during a tree ahead's, after that tree's likeliest path, which the generation
    loop gives."""
    model = Scripted(MODEL)
    hybrid = cost_measured(HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64))
    hybrid.begin([1])
    serial_round(hybrid, (10, 11, 12))
    assert model.read_aheads == [[10, 11, 12]]
    model = Scripted(MODEL)
    # (10-11-12 beyond 10-11-12-99 too)
    hybrid = cost_measured(HybridDrafter(Scripted(REPEATING), model, max_nodes=64))
    hybrid.begin([1])
    pipelined_rounds(hybrid, 3, (10, 11, 12))
    assert model.read_aheads == [[10, 11, 12, 99]] * 3


def test_with_nothing_computed_for_it_the_tree_is_retrievals_and_the_model_hears_the_committed_tokens():
    """Where the verdict ended where the model computed nothing beyond (its draft from known logits is empty),
    the tree is retrieval's draft as retrieval drafted it, its notes included (nothing is merged: merging one
    source's nodes took 0.12 ms of every such round's critical path), which hears its verdict as sent; the
    model hears what was committed."""
    notes = ["retrieval's own", "notes", "for", "each node"]
    retrieval, model = Scripted(replace(RETRIEVAL, notes=notes)), Scripted(DraftTree.empty())
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    tree = after_a_speculation(hybrid).propose()
    assert (tree.tokens, tree.parents, tree.accept_probs, tree.notes) == (
        RETRIEVAL.tokens, RETRIEVAL.parents, RETRIEVAL.accept_probs, notes)
    result = StepResult(tokens=[10, 11, 99], accepted=[0, 1], compute_ms=100.0)
    hybrid.observe(tree, result)
    told_tree, told = retrieval.observed[-1]
    assert told_tree.tokens == RETRIEVAL.tokens and told.accepted == [0, 1]
    told_tree, told = model.observed[-1]
    assert len(told_tree) == 0 and told.tokens == [10, 11, 99] and told.accepted == []


def test_a_tree_ahead_whose_path_the_verdict_before_did_not_commit_teaches_neither_source():
    """Nothing of a tree ahead is left where the verdict before it took another path: both sources hear
    only the committed tokens, no verdict on their nodes."""
    retrieval, model = Scripted(REPEATING), Scripted(MODEL_ADDS)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    first = hybrid.propose()
    ahead = hybrid.propose_after([10, 11, 12, 99])
    hybrid.speculate(lambda: True, then=[10, 11, 12, 99])
    hybrid.observe(first, StepResult(tokens=[10, 13, 7], accepted=spelled(first, (10, 13)), compute_ms=1.0))
    hybrid.observe(ahead.after([10, 13, 7]), StepResult(tokens=[5], accepted=[], compute_ms=1.0))
    for source in (retrieval, model):
        told_tree, told = source.observed[-1]
        assert len(told_tree) == 0 and told.tokens == [5] and told.accepted == []


def serial_round(hybrid: HybridDrafter, take: tuple[int, ...]) -> DraftTree:
    """One round with nothing in flight: the verifier commits the part of `take` the tree spells, and 99."""
    tree = hybrid.propose()
    hybrid.speculate(lambda: True)
    accepted = spelled(tree, take)
    hybrid.observe(tree, StepResult(tokens=[*take[: len(accepted)], 99], accepted=accepted, compute_ms=100.0))
    return tree


def pipelined_rounds(hybrid: HybridDrafter, rounds: int, take: tuple[int, ...]) -> list[DraftTree]:
    """`rounds` trees sent ahead, each below what the verdict in flight commits (the part of `take` its tree
    spells and a bonus token, 99), as edge/generation.py sends them: a tree is drafted once the verdict
    before the one in flight is in. The trees drafted: the first, with nothing in flight, and those sent ahead."""
    in_flight = deque([hybrid.propose()])
    sent = [in_flight[0]]
    for _ in range(rounds):
        verdict = spelled(in_flight[0], take)
        tokens = [*take[: len(verdict)], 99]
        tree = hybrid.propose_after(tokens)
        in_flight.append(tree)
        sent.append(tree)
        hybrid.speculate(lambda: True, then=tokens)
        # (the verdict before a tree ahead committed its path: all of it is left)
        hybrid.observe(in_flight.popleft(), StepResult(tokens=tokens, accepted=verdict, compute_ms=100.0))
    return sent


def spelled(tree: DraftTree, take: tuple[int, ...]) -> list[int]:
    """The nodes of `tree` that spell the longest prefix of `take`: the verifier accepts them."""
    accepted = []
    for token in take:
        parent = accepted[-1] if accepted else -1
        child = next((c for c in tree.children()[parent + 1] if tree.tokens[c] == token), None)
        if child is None:
            break
        accepted.append(child)
    return accepted


class OneTokenSession:
    """A verifier session that commits one token per pass and accepts no draft node."""

    vocab_size, max_tree_tokens, prompt_ids = 100, 64, [1]
    params = SamplingParams(max_new_tokens=6)

    def step(self, tree: DraftTree) -> StepResult:
        return StepResult(tokens=[7], accepted=[], compute_ms=1.0)

    def cost_model(self):
        return None

    def close(self) -> None:
        pass


def test_a_drafter_that_speculates_gets_every_pass_even_with_nothing_to_send():
    """A hybrid whose retrieval has nothing to send and whose model is not drafting this round sends an empty
    tree; its model must still read the verdict-to-be during that pass, or it falls further behind every
    round and never catches up to draft (a bug once: only non-empty trees' passes were given to it)."""
    drafter = Scripted(DraftTree.empty())
    generate(OneTokenSession(), (), drafter)
    assert drafter.proposed == 6 and len(drafter.read_aheads) == 6


def test_a_model_whose_own_nodes_are_never_accepted_speculates_in_one_pass_of_a_few():
    """Where the verdicts take only what retrieval proposed too, the model's forwards during the pass add
    nothing: once it has measured that, it speculates in one pass of PROBE, then of twice as many, and so on; it
    only reads the committed text in the pass before (steps=0) and runs no forward in the others
    (edge/model_worth.py). Its forwards cost the passes 5% (one host); were they free, so would probes be."""
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = cost_measured(HybridDrafter(retrieval, model, max_nodes=64), cost=0.05)
    hybrid.begin([1])
    per_pass = []  # what the model was asked to do during each pass: its speculations' most forwards
    for _ in range(WARM_UP + 1 + 7 * PROBE):
        before = len(model.steps)
        serial_round(hybrid, (10, 11, 12))
        per_pass.append(model.steps[before:])
    # The first pass's tree is not measured (no pass before it), so WARM_UP + 1 passes warm up.
    assert per_pass[: WARM_UP + 1] == [[None]] * (WARM_UP + 1)
    assert per_pass[WARM_UP + 1 :] == sum(([[]] * (n - 2) + [[0], [None]] for n in (PROBE, 2 * PROBE, 4 * PROBE)), [])


def timed_passes(pass_of) -> HybridDrafter:
    """A hybrid through four generations of rounds whose verdicts accept retrieval's path, each pass taking and
    verifying what `pass_of(generation, round, tree, speculated)` says: (ms, nodes verified or None). A
    generation's first pass computes the prompt too: it takes 5 s."""
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    for generation in range(4):
        hybrid.begin([1])
        for i in range(WARM_UP + 4 * PROBE):
            tree = hybrid.propose()
            before = len(model.steps)
            hybrid.speculate(lambda: True)
            ms, verified = pass_of(generation, i, tree, model.steps[before:] == [None])
            accepted = spelled(tree, (10, 11, 12))
            hybrid.observe(tree, StepResult(tokens=[10, 11, 12][: len(accepted)] + [99], accepted=accepted,
                                            compute_ms=5000.0 if i == 0 else ms, verified_nodes=verified))
    return hybrid


def test_the_hybrid_measures_what_the_models_speculation_costs_the_passes_beside_it():
    """Each verdict's pass time is put beside what the model did during it: passes 10% slower while it
    speculates make 10% of the tokens the share it must draft alone (edge/model_worth.py). A generation's first
    pass, which computes the prompt too, is not measured."""
    hybrid = timed_passes(lambda generation, i, tree, speculated: ((100.0 + 10 * len(tree)) *
                                                                   (1.1 if speculated else 1.0), None))
    assert hybrid.worth.costed > 0
    assert hybrid.worth.cost == pytest.approx(0.10, abs=0.02)


def test_passes_are_compared_by_the_nodes_the_verifier_verified_its_own_draft_included():
    """A tree sent ahead may be filled with the verifier's own draft (cloud/verifier_drafter.py), so a pass's time
    follows the nodes it verified (`StepResult.verified_nodes`), not the client's tree. Here the model's forwards
    cost the passes nothing, and passes beside its speculation happen to be filled more: compared by the client's
    trees, they would look dearer and the model would sit out where it costs nothing (on separate machines, by
    timed replay at 80 ms, a 4.5-6.6% cost was measured that way). Here the verifier fills every tree to 12
    nodes, except in every other generation those verified while the model rests."""

    def filled(generation: int, i: int, tree: DraftTree, speculated: bool) -> tuple[float, int]:
        verified = 12 if speculated or generation % 2 == 0 else len(tree)
        return 100.0 + 10 * verified, verified

    hybrid = timed_passes(filled)
    assert hybrid.worth.costed > 0
    assert hybrid.worth.cost == pytest.approx(0.0, abs=1e-9)


def test_a_model_whose_own_nodes_are_accepted_speculates_in_every_pass_but_one_left_alone_to_measure_its_cost():
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = cost_measured(HybridDrafter(retrieval, model, max_nodes=64))
    hybrid.begin([1])
    per_pass = []
    for _ in range(3 * REMEASURE):
        before = len(model.steps)
        serial_round(hybrid, (10, 13))  # 13: the model's alone
        per_pass.append(model.steps[before:])
    assert per_pass == ([[None]] * (REMEASURE - 1) + [[]]) * 3


def test_in_a_generation_the_model_sits_out_the_hybrid_is_retrieval_alone():
    """The same trees as retrieval's, no drafting below a path (retrieval resends its whole draft ahead:
    edge/generation.py), and the verdicts passed on as they come. Merging one source's draft had made the
    hybrid about 3% slower at 80 ms than this, where the model sat out most generations."""
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = cost_measured(HybridDrafter(retrieval, model, max_nodes=64), cost=0.05)
    hybrid.worth.measured = WARM_UP  # none of its tokens accepted: below its share, it sits out
    hybrid.begin([1, 2])
    assert not hasattr(model, "begun")
    assert hybrid.propose_after is None
    tree = hybrid.propose()
    assert tree is RETRIEVAL
    hybrid.speculate(lambda: True)
    result = StepResult(tokens=[10, 11, 99], accepted=[0, 1], compute_ms=100.0)
    hybrid.observe(tree, result)
    assert retrieval.observed == [(RETRIEVAL, result)] and model.steps == [] and model.observed == []
    for _ in range(PROBE - 1):  # the generation it takes part in: the merged tree, drafted below paths too
        hybrid.begin([1, 2])
    assert model.begun == 1 and hybrid.propose_after is not None
    assert paths(after_a_speculation(hybrid).propose())[(10, 13)] == 0.5


def test_a_model_that_does_not_earn_its_forwards_sits_out_generations_but_one_in_a_few():
    """Taking part in a generation means reading its prompt first, forwards beside the verifier's prefill and
    first passes: once its own nodes have not been accepted, the model neither reads nor drafts in a
    generation, except in one of PROBE, and then in ever fewer (edge/model_worth.py), where its forwards cost
    the passes something (5% here, as on one host)."""
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = cost_measured(HybridDrafter(retrieval, model, max_nodes=64), cost=0.05)
    hybrid.begin([1])
    for _ in range(WARM_UP + 1):
        serial_round(hybrid, (10, 11, 12))
    taking_part = []
    for _ in range(3 * PROBE):
        begun, speculated = model.begun, len(model.steps)
        hybrid.begin([1, 2, 3])
        serial_round(hybrid, (10, 11, 12))
        took_part = model.begun > begun
        if not took_part:
            assert len(model.steps) == speculated  # not even a read
        taking_part.append(took_part)
    assert taking_part == [False] * (PROBE - 1) + [True] + [False] * (2 * PROBE - 1) + [True]
