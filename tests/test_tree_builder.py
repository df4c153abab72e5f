"""Draft trees from candidate continuations: within budget and depth, parents first, best nodes first,
probabilities that behave like probabilities, and an acceptance model that learns from answers."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specedge.edge.acceptance_model import AcceptanceModel, NodeStats
from specedge.edge.tree_builder import CandidateSet, build_draft


def candidates(continuations: list[list[int]], weights: list[float], match_lens: list[int],
               long_term: list[bool] | None = None) -> CandidateSet:
    """Continuations (padded with -1 on the right) with their evidence."""
    tokens = np.full((len(continuations), max(map(len, continuations), default=0)), -1, dtype=np.int64)
    for row, c in zip(tokens, continuations):
        row[: len(c)] = c
    return CandidateSet(tokens, np.array(weights, dtype=np.float64), np.array(match_lens, dtype=np.int64),
                        np.array(long_term or [False] * len(continuations), dtype=bool))


def random_candidates(rng: random.Random, n: int) -> tuple[CandidateSet, list[list[int]]]:
    conts = [[rng.randrange(4) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return candidates(conts, [rng.uniform(0.1, 10) for _ in conts], [rng.randint(2, 30) for _ in conts],
                      [rng.random() < 0.3 for _ in conts]), conts


@pytest.mark.parametrize("seed", range(30))
def test_trees_respect_budget_and_depth_and_list_parents_first(seed):
    rng = random.Random(seed)
    max_nodes, max_depth = rng.randint(0, 40), rng.randint(1, 8)
    cands, conts = random_candidates(rng, rng.randint(0, 20))
    tree, stats = build_draft(cands, AcceptanceModel(), max_nodes, max_depth)
    tree.validate(vocab_size=4)  # parents before children, no duplicate siblings
    assert len(tree) <= max_nodes and len(stats.share) == len(tree) == len(tree.accept_probs)
    assert all(d <= max_depth for d in tree.depths())
    for i in range(len(tree)):  # every node is a prefix of some candidate
        path = [tree.tokens[j] for j in tree.path_to(i)]
        assert any(c[: len(path)] == path for c in conts)


@pytest.mark.parametrize("seed", range(30))
def test_accept_probabilities_are_path_products_in_best_first_order(seed):
    rng = random.Random(seed)
    model = AcceptanceModel()
    draft, stats = build_draft(random_candidates(rng, 15)[0], model, 60, 10)
    probs = draft.accept_probs
    cond = model.probs(stats)
    assert all(0 < p <= 1 for p in probs)
    assert probs == sorted(probs, reverse=True)  # best first, so every prefix is the best tree of its size
    for i, parent in enumerate(draft.parents):
        above = 1.0 if parent < 0 else probs[parent]
        assert probs[i] == pytest.approx(above * cond[i])


@pytest.mark.parametrize("seed", range(10))
def test_shares_of_the_children_of_a_node_sum_to_one(seed):
    rng = random.Random(seed)
    cands, conts = random_candidates(rng, 12)
    draft, stats = build_draft(cands, AcceptanceModel(), 1000, 12)
    assert len(draft) == len({tuple(c[:i]) for c in conts for i in range(1, len(c) + 1)})
    children = draft.children()
    for parent, kids in enumerate(children, start=-1):
        if kids:
            total = sum(stats.share[k] for k in kids)
            # a node's continuations may stop there (candidates of different lengths), so at most 1
            assert total <= 1 + 1e-9
            if parent == -1:
                assert total == pytest.approx(1.0)


def test_continuation_counts_decide_the_order():
    cands = candidates([[1, 2, 3], [1, 2, 3], [1, 5], [4]], [1.0] * 4, [8] * 4)
    draft, stats = build_draft(cands, AcceptanceModel(), 10, 10)
    tokens = draft.tokens
    assert tokens[:2] == [1, 2]  # the prefix all but one candidate share comes first
    assert tokens.index(3) < tokens.index(5)  # what followed twice beats what followed once, even deeper
    assert stats.share[0] == pytest.approx(0.75)


def test_no_candidates_give_an_empty_draft():
    draft, stats = build_draft(candidates([], [], []), AcceptanceModel(), 10, 10)
    assert len(draft) == 0 and draft.accept_probs == [] and len(stats.share) == 0


def stats_of(long_term: bool, match_len: int, share: float) -> NodeStats:
    return NodeStats(np.array([long_term]), np.array([match_len]), np.array([share]))


def test_the_acceptance_model_moves_from_its_prior_towards_what_it_observes():
    model = AcceptanceModel()
    f = stats_of(False, match_len=3, share=1.0)
    prior = model.probs(f)[0]
    model.update(np.repeat(f.cells, 50), np.repeat(f.priors, 50), np.ones(50, dtype=bool))
    assert model.probs(f)[0] > 0.9 > prior
    g = stats_of(False, match_len=20, share=0.5)
    model.update(np.repeat(g.cells, 50), np.repeat(g.priors, 50), np.zeros(50, dtype=bool))
    assert model.probs(g)[0] < 0.05
    model.generation.begin()  # (this generation's shift aside)
    assert model.probs(stats_of(True, 3, 1.0))[0] == pytest.approx(prior)  # other cells untouched


def test_a_generation_that_accepts_less_than_the_long_run_lowers_its_own_estimates_only():
    model, f = AcceptanceModel(), stats_of(False, match_len=6, share=1.0)
    rng = np.random.default_rng(0)
    for _ in range(20):  # a long run of generations accepting 80%
        model.generation.begin()
        model.update(np.repeat(f.cells, 50), np.repeat(f.priors, 50), rng.random(50) < 0.8)
    long_run = model.probs(f)[0]
    assert 0.75 < long_run < 0.85
    model.generation.begin()
    model.update(np.repeat(f.cells, 30), np.repeat(f.priors, 30), np.arange(30) < 9)  # this one accepts 30%
    assert model.probs(f)[0] < 0.6  # the tables alone would still say ~0.78
    model.generation.begin()
    assert model.probs(f)[0] > 0.75
