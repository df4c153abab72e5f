"""The hybrid drafter's merge: two best-first drafts become one trie ordered by estimate, each source learns
from its own sent nodes, and a model proposal survives only where a node's children are the model's draws.
The sources here are small scripted drafters (the real ones need a model: test_greedy_equality.py runs the
hybrid end to end)."""

from __future__ import annotations

from collections import deque

import pytest

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge import hybrid as hybrid_module
from specedge.edge.generation import generate
from specedge.edge.hybrid import ALL, EXPLORE_SHARE, MEASURE_ROUNDS, HybridDrafter
from specedge.edge.model_drafter import SPECULATION_STEPS


class Scripted:
    """A drafter that proposes a fixed tree and records what it is told."""

    round_ms = 100.0  # what a model drafter measures: a round's time besides drafting
    token_ms: float | None = None  # ... and one forward (not measured here)
    reading = False  # in the background

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self.observed: list[tuple[DraftTree, StepResult]] = []
        self.proposed = 0
        self.known_only: list[bool] = []  # each draft's `known_only`
        self.speculated: list[int] = []  # the most forwards each speculation was allowed
        self.read_aheads: list[list[int]] = []  # what each speculation was told the verdict likely commits

    def begin(self, prompt_ids, params=None, read: bool = True) -> None:
        pass

    def propose(self, alongside: float = 0.0, known_only: bool = False) -> DraftTree:
        self.proposed += 1
        self.known_only.append(known_only)
        return self.tree

    def propose_after(self, path: list[int], alongside: float = 0.0, known_only: bool = False) -> DraftTree:
        return self.propose(alongside, known_only)

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        self.observed.append((tree, result))

    def learn(self) -> None:
        pass

    def end(self) -> None:
        pass

    def speculate(self, stop, steps: int = SPECULATION_STEPS, then=()) -> None:
        self.speculated.append(steps)
        self.read_ahead = list(then)
        self.read_aheads.append(list(then))

    def behind_ms(self, path=()) -> float:
        return 0.0


def paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)): tree.accept_probs[i] for i in range(len(tree))}


# Retrieval: 10 -> 11 -> 12 (confident), and 20. Model: 10 -> 13 (its own continuation), and 30.
RETRIEVAL = DraftTree([10, 11, 12, 20], [-1, 0, 1, -1], accept_probs=[0.9, 0.8, 0.7, 0.2])
MODEL = DraftTree([10, 13, 30], [-1, 0, -1], accept_probs=[0.95, 0.5, 0.1])


def test_shared_paths_merge_and_nodes_come_best_first():
    hybrid = HybridDrafter(Scripted(RETRIEVAL), Scripted(MODEL), max_nodes=64)
    hybrid.begin([1, 2])
    tree = hybrid.propose()
    tree.validate(100)
    assert paths(tree) == {(10,): 0.95, (10, 11): 0.8, (10, 11, 12): 0.7, (10, 13): 0.5, (20,): 0.2, (30,): 0.1}
    assert tree.accept_probs == sorted(tree.accept_probs, reverse=True)
    assert tree.proposals is None


def test_the_node_budget_keeps_the_best_nodes():
    hybrid = HybridDrafter(Scripted(RETRIEVAL), Scripted(MODEL), max_nodes=3)
    hybrid.begin([1])
    assert set(paths(hybrid.propose())) == {(10,), (10, 11), (10, 11, 12)}


def test_each_source_hears_about_the_nodes_of_its_own_that_were_sent():
    retrieval, model = Scripted(RETRIEVAL), Scripted(MODEL)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    tree = hybrid.propose().prefix(4)  # the controller sent 10, 10-11, 10-11-12, 10-13
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
    tree = hybrid.propose()
    tree.validate(100)
    assert tree.proposals == {tree.tokens.index(13): q_after_13}
    under_ten = [tree.tokens[c] for c in tree.children()[tree.tokens.index(10) + 1]]
    assert sorted(under_ten) == [11, 13]
    # The same draws without retrieval's candidates: every proposal stands.
    alone = HybridDrafter(Scripted(DraftTree.empty()), Scripted(sampled), max_nodes=64)
    alone.begin([1])
    assert len(alone.propose().proposals) == 3


# A fresh hybrid measures before it decides: it drafts with the model MEASURED times (G and D; all but the
# first round timed, R_m), then once without (R).
MEASURED = MEASURE_ROUNDS


class Clock:
    """perf_counter for the hybrid: time moves only when a test's drafter or verifier spends it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, ms: float) -> None:
        self.now += ms / 1e3


class TimedModel(Scripted):
    """A scripted model drafter that takes `ms` to draft, and `read_ms` per committed token it has to read
    first: those of the verdict beyond what it read ahead during the pass (speculate's `then`)."""

    def __init__(self, tree: DraftTree, clock: Clock, ms: float = 50.0, read_ms: float = 0.0) -> None:
        super().__init__(tree)
        self.clock, self.ms, self.read_ms = clock, ms, read_ms
        self.token_ms = read_ms or None  # a forward reads one token
        self.unread, self.read_ahead = 0, []

    def propose(self, alongside: float = 0.0, known_only: bool = False) -> DraftTree:
        if not known_only:  # (known only: what it computed while speculating, no forward now)
            self.clock.spend(self.ms + self.behind_ms())
            self.unread = 0
        return super().propose(alongside, known_only)

    def speculate(self, stop, steps: int, then=()) -> None:
        super().speculate(stop, steps, then)
        self.unread = 0

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        super().observe(tree, result)
        matched = next((i for i, (a, b) in enumerate(zip(result.tokens, self.read_ahead)) if a != b),
                       min(len(result.tokens), len(self.read_ahead)))
        self.unread += len(result.tokens) - matched
        self.read_ahead = []

    def behind_ms(self, path=()) -> float:  # (it reads ahead whatever path it drafts beyond: `then`)
        return self.unread * self.read_ms


MODEL_ADDS = DraftTree([10, 13, 14, 15], [-1, 0, 1, 2], accept_probs=[0.95, 0.5, 0.4, 0.3])  # 13-14-15: its own


@pytest.mark.parametrize("model_adds", [False, True])
def test_the_model_drafts_only_where_it_adds_more_than_it_costs(monkeypatch, model_adds):
    """Retrieval is confident (10-11-12, 2.6 tokens expected); the model proposes 10-13-14-15 in 50 ms of a
    100 ms round. When the verifier never takes 13, the model stops drafting there (exploring rounds are
    rarer than these 16 rounds: a later test); when it takes 13-14-15 (3 tokens beyond retrieval's 10:
    (3.6 + 3) / (100 + 50) ms beats 3.6 / 100 ms), it drafts every round."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    retrieval = Scripted(RETRIEVAL)
    model = TimedModel(MODEL_ADDS, clock)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    rounds = 16
    run_rounds(hybrid, model, rounds, take=(10, 13, 14, 15) if model_adds else (10, 11, 12))
    assert retrieval.proposed == rounds
    # Measuring (MEASURED rounds with the model, then one without); then every round, or none.
    assert model.proposed == (rounds - 1 if model_adds else MEASURED)


@pytest.mark.parametrize(("read_ms", "every"), [(5.0, 1), (25.0, 2)])
def test_what_the_model_must_read_before_drafting_counts_against_it(monkeypatch, read_ms, every):
    """As above, the verifier taking the model's 13-14-15. During each pass the model reads ahead what the
    verdict most likely commits: the merged tree's likeliest path, retrieval's 10-11-12 (estimates 0.9,
    0.8, 0.7). A verdict that takes 13-14-15 leaves four tokens to read before the next draft (13, 14, 15
    and the bonus); one from a round without the model (10 and the bonus) leaves one. At 5 ms a token the
    model pays either way (6.6 / 170 ms beats 3.6 / 100 ms); at 25 ms only after a round without it
    (6.6 / 175 ms, but 6.6 / 250 ms does not), so it drafts every other round."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(MODEL_ADDS, clock, read_ms=read_ms)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.begin([1])
    rounds = 16
    drafted = run_rounds(hybrid, model, rounds, take=(10, 13, 14, 15))
    assert set(map(tuple, model.read_aheads)) == {(10, 11, 12)}  # what each speculation read ahead
    # Measuring (MEASURED rounds with the model, then one without), then every round or every other one.
    assert drafted == [*range(MEASURED), *range(MEASURED + 1, rounds, every)]


def test_a_verdict_the_model_read_ahead_costs_it_no_reading(monkeypatch):
    """The verdict takes retrieval's likeliest path 10-11-12, which the model read during the pass (of the
    round without it that times R, after MEASURED rounds with it): only the bonus token is left to read."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(MODEL_ADDS, clock, read_ms=25.0)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.begin([1])
    assert model_rounds(hybrid, model, MEASURED + 1, take=(10, 11, 12))[-1] == "read"
    assert model.behind_ms() == 25.0


class Sequence(Scripted):
    """A scripted drafter that proposes the given trees in turn (the last one for ever)."""

    def __init__(self, *trees: DraftTree) -> None:
        super().__init__(trees[0])
        self.trees = trees

    def propose(self, alongside: float = 0.0, known_only: bool = False) -> DraftTree:
        self.tree = self.trees[min(self.proposed, len(self.trees) - 1)]
        return super().propose(alongside, known_only)


def test_each_bucket_of_retrievals_confidence_measures_the_model_once(monkeypatch):
    """Retrieval is very confident (2.6 tokens expected) for 8 rounds, then less so (1.5: another bucket), and
    right either way; the model adds nothing. The hybrid measures the model (MEASURED rounds with it, one
    without), and then once more in the new bucket: what the model adds depends most on how sure
    retrieval is."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    less_sure = DraftTree(RETRIEVAL.tokens, RETRIEVAL.parents, accept_probs=[0.6, 0.5, 0.3, 0.1])
    model = TimedModel(MODEL_ADDS, clock)
    hybrid = HybridDrafter(Sequence(*[RETRIEVAL] * 8, less_sure), model, max_nodes=64)
    hybrid.begin([1])
    drafted = run_rounds(hybrid, model, 16, take=(10, 11, 12))
    assert drafted == [*range(MEASURED), 8]


def test_a_bucket_not_measured_yet_is_no_reason_for_a_model_far_behind_to_read(monkeypatch):
    """As above, but reading costs the model 25 ms a token. After measuring it rests, reading nothing: each
    verdict's 4 tokens stay unread. When retrieval becomes less sure (round 8, a bucket not measured yet),
    drafting would first read 21 tokens (525 ms, ten times its 50 ms of drafting): the bucket is measured
    only when the exploring budget pays for that, as where the model does not pay (a long prompt left unread
    was once read beside every pass of a generation to measure a bucket, and the model never drafted)."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    less_sure = DraftTree(RETRIEVAL.tokens, RETRIEVAL.parents, accept_probs=[0.6, 0.5, 0.3, 0.1])
    model = TimedModel(MODEL_ADDS, clock, read_ms=25.0)
    hybrid = HybridDrafter(Sequence(*[RETRIEVAL] * 8, less_sure), model, max_nodes=64)
    hybrid.begin([1])
    did = model_rounds(hybrid, model, 12, take=(10, 11, 12))
    assert did == ["draft"] * MEASURED + ["read"] + ["rest"] * (12 - MEASURED - 1)


def test_a_resting_round_is_retrievals_alone_and_the_model_hears_only_the_committed_tokens(monkeypatch):
    """Where the model rests the round costs what retrieval alone would: its tree goes as it is, without a
    merge, and its verdict reaches retrieval as sent; the model is told only what was committed."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    retrieval, model = Scripted(RETRIEVAL), TimedModel(MODEL_ADDS, clock, read_ms=25.0)
    hybrid = HybridDrafter(retrieval, model, max_nodes=64)
    hybrid.begin([1])
    assert model_rounds(hybrid, model, MEASURED + 3, take=(10, 11, 12))[-1] == "rest"
    tree = hybrid.propose()
    assert tree is RETRIEVAL and model.proposed == MEASURED
    result = StepResult(tokens=[10, 11, 99], accepted=[0, 1], compute_ms=100.0)
    hybrid.observe(tree, result)
    assert retrieval.observed[-1] == (RETRIEVAL, result)
    told_tree, told = model.observed[-1]
    assert len(told_tree) == 0 and told.tokens == [10, 11, 99] and told.accepted == []


def test_a_model_that_pays_in_some_buckets_keeps_reading_in_the_others(monkeypatch):
    """Retrieval is confident (2.6 tokens expected) and unsure (0.3) in turn; the verifier takes the model's
    13-14-15 either way, but drafting costs 150 ms, which pays only where retrieval is unsure ((1.3 + 3) /
    250 ms beats 1.3 / 100 ms; 6.6 / 250 ms does not beat 3.6 / 100 ms). It reads during the passes of the
    confident rounds (it paid within WANTED_LATELY rounds), so each unsure round finds only the bonus token
    unread and drafts; were it to rest there, it would find 5 tokens (125 ms) unread, which would not pay."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    unsure = DraftTree(RETRIEVAL.tokens, RETRIEVAL.parents, accept_probs=[0.1, 0.1, 0.05, 0.05])
    model = TimedModel(MODEL_ADDS, clock, ms=150.0, read_ms=25.0)
    hybrid = HybridDrafter(Sequence(*[RETRIEVAL, unsure] * 10), model, max_nodes=64)
    hybrid.begin([1])
    did = model_rounds(hybrid, model, 20, take=(10, 13, 14, 15))
    assert did == ["draft"] * MEASURED + ["read", "draft"] * ((20 - MEASURED) // 2)


def test_a_model_that_pays_only_with_nothing_to_read_does_not_read_beside_every_pass(monkeypatch):
    """The verifier takes the model's 13-14-15, but drafting costs 81 ms: had the model read everything
    committed, a round with it would gain 2 ms ((3.6 + 3) / 181 ms against 3.6 / 100 ms). It seldom has: a
    round after one in which it read during the pass still has the verdict's bonus token to read (5 ms), and
    with it drafting loses 3 ms. So the model drafts in exploring rounds (each costs 3 + 5 ms of the budget),
    each after reading during the pass before it, and rests in most others; it never reads during two passes
    in a row. Counted as paying, it read during every pass for a draft that never came; reading as soon as
    the budget paid for the 3 ms alone, it read during pass after pass, each time one forward short."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(MODEL_ADDS, clock, ms=81.0, read_ms=5.0)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.begin([1])
    did = model_rounds(hybrid, model, 400, take=(10, 13, 14, 15))
    after = "".join({"draft": "D", "read": "R", "rest": "."}[what] for what in did[MEASURED + 1:])
    assert "RR" not in after and after.count("D") >= len(after) * EXPLORE_SHARE * 100.0 / (3 + 5) - 2


def test_a_model_whose_drafts_are_never_worth_sending_stops_drafting(monkeypatch):
    """The model is unsure (its one node, 30, is estimated at 0.05), so the controller sends only retrieval's
    10-11-12 of the merged tree, which the verifier takes: the model's 50 ms of drafting buy nothing. Those
    rounds are the model's rounds all the same (G is per round it drafted): it drafts MEASURED of them, and
    then only when the exploring budget pays for one. Counted by its sent nodes instead, it never finished
    measuring and drafted every round."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(DraftTree([30], [-1], accept_probs=[0.05]), clock)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.begin([1])
    did = model_rounds(hybrid, model, 40, take=(10, 11, 12), send=3)
    assert did[: MEASURED + 1] == ["draft"] * MEASURED + ["read"]
    # Exploring: each round after those puts aside EXPLORE_SHARE of its 100 ms; a round with the model loses 50
    assert did[MEASURED + 1:].count("draft") <= (40 - MEASURED - 1) * EXPLORE_SHARE * 100.0 / 50.0


def test_when_the_text_changes_a_few_rounds_in_any_bucket_tell_every_bucket(monkeypatch):
    """Retrieval is confident (2.6 tokens expected), less so (1.5) and unsure (0.3) in turn. For 30 rounds the
    verifier takes the model's 13-14 beyond retrieval's 10 (G = 2: the model pays in each bucket), then only
    retrieval's 10-11-12 (G = 0). The model's level falls with every round it drafts in, whatever the bucket,
    so it stops within a few rounds (2 x 0.8 ** k, times each bucket's shape of ~1, falls below what pays);
    with a G of each bucket's own, each bucket needed rounds of its own to learn the news (10 in all)."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    less_sure = DraftTree(RETRIEVAL.tokens, RETRIEVAL.parents, accept_probs=[0.6, 0.5, 0.3, 0.1])
    unsure = DraftTree(RETRIEVAL.tokens, RETRIEVAL.parents, accept_probs=[0.1, 0.1, 0.05, 0.05])
    model = TimedModel(MODEL_ADDS, clock, ms=50.0)
    hybrid = HybridDrafter(Sequence(*[RETRIEVAL, less_sure, unsure] * 40), model, max_nodes=64)
    hybrid.begin([1])
    assert model_rounds(hybrid, model, 30, take=(10, 13, 14))[MEASURED + 1:] == ["draft"] * (30 - MEASURED - 1)
    after = model_rounds(hybrid, model, 30, take=(10, 11, 12))
    assert "rest" in after and after[: after.index("rest")].count("draft") <= 5


def run_rounds(hybrid: HybridDrafter, model: TimedModel, rounds: int, take: tuple[int, ...]) -> list[int]:
    """`rounds` rounds of 100 ms in which the verifier commits `take` (and a bonus token); the rounds the model
    drafted."""
    return [r for r, did in enumerate(model_rounds(hybrid, model, rounds, take)) if did == "draft"]


def model_rounds(hybrid: HybridDrafter, model: TimedModel, rounds: int, take: tuple[int, ...],
                 reading_slows: float = 0.0, send: int | None = None, held_back: list[bool] | None = None
                 ) -> list[str]:
    """As run_rounds; what the model did in each round: "draft", "read" (during the pass, without drafting) or
    "rest". `reading_slows`: by what share the pass is longer where the model works during it. `send`: the
    nodes the controller sends of each tree (all by default). `held_back`: each round also drafts a tree
    ahead, which the controller holds back (its drafting within the pass), and whether the model drafted it
    is appended here."""
    did = []
    for _ in range(rounds):
        proposed, speculated = model.proposed, len(model.speculated)
        tree = hybrid.propose()
        tree = tree if send is None else tree.prefix(send)
        if held_back is not None:
            before, now = model.proposed, model.clock.now
            hybrid.propose_after([*take, 99])
            held_back.append(model.proposed > before)
            model.clock.now, model.proposed = now, before
        hybrid.speculate(lambda: True)
        did.append("draft" if model.proposed > proposed else "read" if len(model.speculated) > speculated else "rest")
        accepted = spelled(tree, take)
        model.clock.spend(100.0 * (1.0 + (reading_slows if did[-1] != "rest" else 0.0)))
        hybrid.observe(tree, StepResult(tokens=[*take[: len(accepted)], 99], accepted=accepted, compute_ms=100.0))
    return did


@pytest.mark.parametrize("model_ms", [50.0, 10.0])
def test_exploring_where_the_model_does_not_pay_costs_a_bounded_share_of_the_time(monkeypatch, model_ms):
    """Where retrieval is confident and right, the model adds nothing, and a round with it loses its
    drafting time (the pass takes 100 ms either way). After MEASURED rounds it still drafts now and then,
    so that what it adds stays measured, spending at most EXPLORE_SHARE of the time (and not much less);
    a cheaper model explores more often. Only the rounds it drafts does it speculate in; in the others it
    rests, reading nothing, but for the round that times R without it (it reads, one forward beyond the
    verdict)."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(MODEL_ADDS, clock, model_ms)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.begin([1])
    rounds = 1000
    did = model_rounds(hybrid, model, rounds, take=(10, 11, 12))
    drafted = [r for r, what in enumerate(did) if what == "draft"]
    assert drafted[:MEASURED] == list(range(MEASURED))
    exploring = len(drafted) - MEASURED
    budget = (rounds - MEASURED - 1) * EXPLORE_SHARE * 100.0  # after the round without the model that times R
    assert budget - model_ms < exploring * model_ms <= budget
    assert [steps for steps in model.speculated if steps != 1] == [SPECULATION_STEPS] * len(drafted)
    assert [r for r, what in enumerate(did) if what == "read"] == [MEASURED]


def test_exploring_after_a_rest_pays_for_reading_what_the_model_missed(monkeypatch):
    """Where the model does not pay it rests, and each verdict's 4 tokens stay unread. An exploring round
    reads them first, during the pass before it: free where edge and verifier are separate machines, but
    where they share one, reading beside a pass slows it (here by 20%, as the hybrid measures from rounds in
    which the model read and rested), and what that costs comes out of the same budget (EXPLORE_SHARE of the
    bucket's time): there it explores less than half as often. (Reading a token takes as long here as makes
    each rested round's unread tokens cost 80% of what the round sets aside; where they cost more, the
    budget never catches up with the reading and the bucket stops exploring.)"""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    explored = {}
    read_ms = 0.8 * EXPLORE_SHARE * 100.0 / (0.2 * 4)
    for reading_slows in (0.0, 0.2):
        model = TimedModel(MODEL_ADDS, clock, 10.0, read_ms=read_ms)
        hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
        hybrid.begin([1])
        did = model_rounds(hybrid, model, 1000, take=(10, 11, 12), reading_slows=reading_slows)
        assert did[: MEASURED + 1] == ["draft"] * MEASURED + ["read"]  # the last times R without the model
        after = "".join({"draft": "D", "read": "R", "rest": "."}[what] for what in did[MEASURED + 1:])
        # It reads in the round before each it explores in (the last round's: after the run), else rests.
        assert set(after.removesuffix("R").replace("RD", "")) == {"."}
        explored[reading_slows] = did.count("draft") - MEASURED
        # Measured from a round it read in and the next, in which it rested; R is a round's time at rest.
        assert hybrid._slowed_by_reading() == pytest.approx(reading_slows)
        assert hybrid._round_ms[ALL, 0] == pytest.approx(100.0)
    assert 0 < explored[0.2] < explored[0.0] / 2


def test_a_model_whose_nodes_lengthen_the_pass_more_than_they_add_stops_drafting(monkeypatch):
    """Retrieval expects 2.6 tokens; the model adds three more per round in 50 ms of drafting, which pays in
    a 100 ms round (6.6 / 150 ms > 3.6 / 100 ms); but when the verdict takes 100 ms longer to come when it
    drafts (its speculation outlasts the verifier's 100 ms pass, or its nodes make the pass longer), it does
    not (6.6 / 250 ms): rounds with and without it are timed apart, from sending the tree to the verdict."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(DraftTree([10, 11, 13, 14, 15], [-1, 0, 1, 2, 3], accept_probs=[0.95, 0.8, 0.5, 0.4, 0.3]),
                       clock)
    for extra_ms, drafts in ((0.0, True), (100.0, False)):
        hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
        hybrid.begin([1])
        drafted = []
        for _ in range(3 * MEASURED):
            before = model.proposed
            tree = hybrid.propose()
            with_model = model.proposed > before
            drafted.append(with_model)
            tree = tree.prefix(len(tree) if with_model else 3)  # without the model: retrieval's 10-11-12
            take = (10, 11, 13, 14, 15) if with_model else (10, 11)
            accepted = [next(i for i in range(len(tree)) if tuple(tree.tokens[j] for j in tree.path_to(i)) == take[:k])
                        for k in range(1, len(take) + 1)]
            ms = 100.0 + (extra_ms if with_model else 0.0)
            clock.spend(ms)
            hybrid.observe(tree, StepResult(tokens=[*take, 99], accepted=accepted, compute_ms=100.0))
        assert drafted[:MEASURED + 1] == [True] * MEASURED + [False]  # measuring: with the model, then without
        assert all(drafted[MEASURED + 1:]) if drafts else not any(drafted[MEASURED + 1:])


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
    assert drafter.proposed == 6 and len(drafter.speculated) == 6


@pytest.mark.parametrize("split", [True, False])
def test_rounds_after_the_model_led_keep_figures_of_their_own(monkeypatch, split):
    """Retrieval is confident (2.6 tokens expected) every round, so one bucket holds them all. The model
    leads a round when the verifier takes its 13-14-15 to the end of the tree; here it is right in every
    round after one it did not lead, and adds nothing after one it led. Rounds after a lead keep their own
    figures (G = 0 there, 3 in the others), so the model drafts in every round that follows one it did not
    lead, and after a lead only to explore. With one set of figures for the bucket (`split_after_led` off)
    it sees G ~ 1.5, which does not pay for its 50 ms ((3.6 + 1.5) / 150 ms < 3.6 / 100 ms), and it drafts
    only to explore. (The text that asked for this: a structure the model repeats, a dozen of its tokens
    taken, then retrieval's long match that follows, confident, commits two.)"""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(MODEL_ADDS, clock)
    hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
    hybrid.split_after_led = split
    hybrid.begin([1])
    led, after_lead, after_none = False, [], []
    for r in range(40):
        take = (10, 11, 12) if led else (10, 13, 14, 15)
        drafted = model_rounds(hybrid, model, 1, take) == ["draft"]
        if r > MEASURED:
            (after_lead if led else after_none).append(drafted)
        led = drafted and take == (10, 13, 14, 15)
    if split:
        assert all(after_none) and sum(after_lead) <= len(after_lead) / 4
    else:
        assert sum(after_none) < len(after_none) / 2


# Retrieval that drafts 10-11-12 beyond the path 10-11-12-99 too, and a model the verifier never follows
REPEATING = DraftTree([10, 11, 12, 99, 10, 11, 12], list(range(-1, 6)), accept_probs=[0.9] * 7)
WRONG = DraftTree([13, 14, 15], [-1, 0, 1], accept_probs=[0.5, 0.4, 0.3])


@pytest.mark.parametrize("retrieval, model_draft, take", [
    (RETRIEVAL, MODEL_ADDS, (10, 13, 14, 15)),  # the model adds 13-14-15
    (REPEATING, WRONG, (10, 11, 12)),  # it adds nothing
], ids=["model-adds", "model-adds-nothing"])
def test_every_tree_ahead_gets_what_the_model_computed_during_the_passes_and_waits_on_no_forward(
        monkeypatch, retrieval, model_draft, take):
    """The model's drafting costs 150 ms: in serial rounds of 100 ms that does not pay even where the verifier
    takes its 13-14-15 (6.6 / 250 ms against 3.6 / 100 ms), and it drafts only to measure and explore. A
    tree sent ahead must reach the verifier before the pass in flight ends, and a model drafting then made it
    late (BENCHMARKS.md section 8): its part of a tree ahead is what it computed while the verifier checked
    the trees before (`known_only`), which costs no time, so it has one in every tree ahead once a tree
    ahead has had its verdict, whether or not it adds anything."""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(model_draft, clock, ms=150.0)
    hybrid = HybridDrafter(Scripted(retrieval), model, max_nodes=64)
    hybrid.begin([1])
    serial = run_rounds(hybrid, model, 40, take=take)
    assert len(serial) <= MEASURED + 2
    assert not any(model.known_only)
    drafted = pipelined_rounds(hybrid, model, 40, take=take)
    # The first two trees ahead go as the serial round in flight chose (the model rests): no tree ahead has
    # had its verdict yet (over a short round trip the controller holds them back)
    assert drafted == list(range(2, 40))
    assert model.known_only[len(serial):] == [True] * len(drafted)


@pytest.mark.parametrize("retrieval, model_draft, take, serial, ways", [
    (RETRIEVAL, MODEL_ADDS, (10, 13, 14, 15), True, [[], None]),  # the model pays in both
    (REPEATING, WRONG, (10, 11, 12), True, [[10, 11, 12]]),  # it adds nothing, and drafts ahead only to explore
    (REPEATING, WRONG, (10, 11, 12), False, [[10, 11, 12], None]),  # no serial rule yet
], ids=["model-pays", "model-explores", "serial-unmeasured"])
def test_a_tree_ahead_is_weighed_against_the_ways_the_hybrid_may_draft_after_the_verdict(
        monkeypatch, retrieval, model_draft, take, serial, ways):
    """The controller weighs a tree ahead that the model drafted against waiting for the verdict and drafting
    after it: retrieval's part beyond the path at once, or the whole tree after the model's drafting time
    and a forward for the verdict's bonus token; the latter not where the serial rule, measured, would have
    the model rest. (Where the model's part was offered without its time, waiting looked best below any
    unlikely path, and the hybrid held back 4 times as many trees ahead as retrieval alone.)"""
    monkeypatch.setattr(hybrid_module, "time", clock := Clock())
    model = TimedModel(model_draft, clock, ms=10.0, read_ms=2.0)
    hybrid = HybridDrafter(Scripted(retrieval), model, max_nodes=64)
    hybrid.begin([1])
    if serial:
        run_rounds(hybrid, model, 40, take=take)
    pipelined_rounds(hybrid, model, 20, take=take)
    for _ in range(100):  # trees ahead (never sent) until the model drafts one
        proposed = model.proposed
        hybrid.propose_after([*take, 99])
        if model.proposed > proposed:
            break
    assert model.proposed > proposed
    offered = hybrid.waiting()
    assert [None if tree is None else tree.tokens for tree, _ in offered] == ways
    assert [ms for _, ms in offered] == [0.0, pytest.approx(hybrid.model_ms + 2.0)][: len(ways)]


def pipelined_rounds(hybrid: HybridDrafter, model: TimedModel, rounds: int, take: tuple[int, ...],
                     trip_ms: float = 200.0, pass_ms: float = 20.0, filled: int = 0) -> list[int]:
    """`rounds` trees sent ahead, each below what the verdict in flight commits (the part of `take` its tree
    spells and a bonus token), as edge/generation.py sends them: a tree is drafted once the verdict before the
    one in flight is in, and its verdict comes `trip_ms` after it was sent (drafted), and `pass_ms` after the
    verdict before it; where a tree is bare the verifier drafts the first `filled` tokens of `take` itself.
    The rounds the model drafted in."""
    due = model.clock.now + trip_ms / 1e3
    in_flight = deque([(hybrid.propose(), due)])
    drafted = []
    for r in range(rounds):
        proposed = model.proposed
        verdict = spelled(in_flight[0][0], take)
        fill = 0 if len(in_flight[0][0]) else filled
        tokens = [*take[: len(verdict) + fill], 99]
        tree = hybrid.propose_after(tokens)
        due = max(model.clock.now + trip_ms / 1e3, due + pass_ms / 1e3)
        in_flight.append((tree, due))
        if model.proposed > proposed:
            drafted.append(r)
        hybrid.speculate(lambda: True, then=tokens)
        tree, verdict_at = in_flight.popleft()  # (the verdict before a tree ahead committed its path: all is left)
        model.clock.now = max(model.clock.now, verdict_at)
        hybrid.observe(tree, StepResult(tokens=tokens, accepted=verdict, compute_ms=100.0, verifier_drafted=fill))
    return drafted


def test_where_retrieval_leaves_a_tree_ahead_bare_the_model_is_credited_beyond_the_verifiers_own_draft(
        monkeypatch):
    """Retrieval has nothing beyond the path a tree ahead hangs below; the verifier accepts the model's 10-11.
    Without it the tree would go bare and the verifier would draft for it, committing `filled` tokens: the
    model's G there (which the serial rule weighs its drafting time against) is what it commits beyond that,
    1 token where the verifier's draft commits 1, none where it commits 3. Trees ahead go bare to measure it
    until the first one's verdict (two, with two trees in flight); the model has its part in every other."""
    for filled, gain in ((1, 1.0), (3, 0.0)):
        monkeypatch.setattr(hybrid_module, "time", clock := Clock())
        model = TimedModel(DraftTree([10, 11], [-1, 0], accept_probs=[0.9, 0.8]), clock, ms=20.0)
        hybrid = HybridDrafter(Scripted(DraftTree([10], [-1], accept_probs=[0.9])), model, max_nodes=64)
        hybrid.begin([1])
        drafted = pipelined_rounds(hybrid, model, 200, take=(10, 11, 12, 13), filled=filled)
        assert len(drafted) == 198
        assert hybrid._level == pytest.approx(gain, abs=0.1)  # (the level is G in a bucket of shape 1)


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


def test_trees_ahead_held_back_leave_the_serial_rounds_as_they_were(monkeypatch):
    """Over a short round trip the controller holds nearly every tree ahead back: the verdict comes before one
    would pay. A hybrid asked for one each round (its drafting done within the pass) makes the same choices
    in its serial rounds as one never asked, exploring included (a held-back tree neither puts aside nor
    spends exploring time); and with no tree ahead sent yet, the model drafts a tree ahead where it drafts
    the round whose verdict is awaited (one such tree once "measured" by drafting, held back, every round)."""
    runs, held_back = [], []
    for asked in (None, held_back):
        monkeypatch.setattr(hybrid_module, "time", clock := Clock())  # (the same clock readings for both)
        # (a drafting time that no sum of exploring budgets meets exactly: a tie would be decided by rounding)
        model = TimedModel(MODEL_ADDS, clock, 14.142)
        hybrid = HybridDrafter(Scripted(RETRIEVAL), model, max_nodes=64)
        hybrid.begin([1])
        runs.append(model_rounds(hybrid, model, 400, take=(10, 11, 12), held_back=asked))
    assert runs[0] == runs[1]
    assert runs[0].count("draft") > MEASURED + 5  # it explores
    assert held_back == [did == "draft" for did in runs[1]]
