"""Draft trees from candidate continuations: within budget and depth, parents first, best nodes first,
probabilities that behave like probabilities, and an acceptance model that learns from answers."""

from __future__ import annotations

import random

import pytest

from specedge.edge.acceptance_model import AcceptanceModel, NodeFeatures
from specedge.edge.tree_builder import Candidate, build_draft


def random_candidates(rng: random.Random, n: int) -> list[Candidate]:
    return [Candidate([rng.randrange(4) for _ in range(rng.randint(1, 12))], weight=rng.uniform(0.1, 10),
                      match_len=rng.randint(2, 30), long_term=rng.random() < 0.3) for _ in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_trees_respect_budget_and_depth_and_list_parents_first(seed):
    rng = random.Random(seed)
    max_nodes, max_depth = rng.randint(0, 40), rng.randint(1, 8)
    draft, features = build_draft(random_candidates(rng, rng.randint(0, 20)), AcceptanceModel(), max_nodes, max_depth)
    tree = draft.tree
    tree.validate(vocab_size=4)  # parents before children, no duplicate siblings
    assert len(tree) <= max_nodes and len(features) == len(tree) == len(draft.accept_probs)
    assert all(d <= max_depth for d in tree.depths())
    assert [f.depth for f in features] == tree.depths()


@pytest.mark.parametrize("seed", range(30))
def test_accept_probabilities_are_path_products_in_best_first_order(seed):
    rng = random.Random(seed)
    model = AcceptanceModel()
    draft, features = build_draft(random_candidates(rng, 15), model, 60, 10)
    probs = draft.accept_probs
    assert all(0 < p <= 1 for p in probs)
    assert probs == sorted(probs, reverse=True)  # best first, so every prefix is the best tree of its size
    for i, parent in enumerate(draft.tree.parents):
        above = 1.0 if parent < 0 else probs[parent]
        assert probs[i] == pytest.approx(above * model.prob(features[i]))


@pytest.mark.parametrize("seed", range(10))
def test_shares_of_the_children_of_a_node_sum_to_one(seed):
    rng = random.Random(seed)
    draft, features = build_draft(random_candidates(rng, 12), AcceptanceModel(), 1000, 12)
    children = draft.tree.children()
    for parent, kids in enumerate(children, start=-1):
        if kids:
            total = sum(features[k].share for k in kids)
            # a node's continuations may stop there (candidates of different lengths), so at most 1
            assert total <= 1 + 1e-9
            if parent == -1:
                assert total == pytest.approx(1.0)


def test_continuation_counts_decide_the_order():
    cands = [Candidate([1, 2, 3], 1.0, 8), Candidate([1, 2, 3], 1.0, 8), Candidate([1, 5], 1.0, 8),
             Candidate([4], 1.0, 8)]
    draft, features = build_draft(cands, AcceptanceModel(), 10, 10)
    tokens = draft.tree.tokens
    assert tokens[:2] == [1, 2]  # the prefix all but one candidate share comes first
    assert tokens.index(3) < tokens.index(5)  # what followed twice beats what followed once, even deeper
    assert features[0].share == pytest.approx(0.75)


def test_no_candidates_give_an_empty_draft():
    draft, features = build_draft([], AcceptanceModel(), 10, 10)
    assert len(draft.tree) == 0 and draft.accept_probs == [] and features == []


def test_the_acceptance_model_moves_from_its_prior_towards_what_it_observes():
    model = AcceptanceModel()
    f = NodeFeatures(long_term=False, match_len=3, depth=1, share=1.0)
    prior = model.prob(f)
    for _ in range(50):
        model.update(f, accepted=True)
    assert model.prob(f) > 0.9 > prior
    g = NodeFeatures(long_term=False, match_len=20, depth=4, share=0.5)
    for _ in range(50):
        model.update(g, accepted=False)
    assert model.prob(g) < 0.05
    assert model.prob(NodeFeatures(True, 3, 1, 1.0)) == pytest.approx(prior)  # other cells untouched
