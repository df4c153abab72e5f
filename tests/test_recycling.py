"""Token Recycling on the edge: the verifier's hints are kept per token and per pair of tokens (the pair
first), drafts grow best first from them under the node budget and merge with retrieval's, the table's
calibration learns from verdicts, and the retrieval drafter drafts from hints without changing output."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.cloud.engine import Engine
from specedge.cloud.local import LocalVerifier
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge import recycling
from specedge.edge.calibration import reached_and_accepted
from specedge.edge.controller import TreeSizeController
from specedge.edge.generation import generate
from specedge.edge.recycling import Recycler, RecyclingTable
from specedge.edge.retrieval import RetrievalDrafter
from tiny_models import tiny_llama


def rows(*pairs: tuple[list[int], list[float]]) -> Hints:
    return Hints([ids for ids, _ in pairs], [probs for _, probs in pairs])


def read(table: RecyclingTable, context: tuple[int, ...]) -> tuple[list[int], list[int], int] | None:
    """A row as (token ids, probability bytes, kind)."""
    row = table.row(context)
    if row is None:
        return None
    hints, kind = row
    return [h >> 8 for h in hints if h >= 0], [h & 255 for h in hints if h >= 0], kind


def test_the_newest_row_is_kept_and_the_longest_known_context_is_read_first(monkeypatch):
    monkeypatch.setattr(recycling, "CONTEXT", 3)
    table = RecyclingTable(k=3)
    table.update([(7, 1, 5)], rows(([6, 7, 8], [0.6, 0.2, 0.1])))
    table.update([(8, 2, 5)], rows(([9, 6], [0.9, 0.05])))  # a shorter row: fewer than k tokens
    assert read(table, (8, 2, 5)) == ([9, 6], [230, 13], 2)  # by three tokens
    assert read(table, (0, 1, 5)) == ([6, 7, 8], [153, 51, 26], 1)  # by two
    assert read(table, (3, 5)) == ([9, 6], [230, 13], 0)  # an unseen context: the token's newest row
    assert read(table, (5,)) == ([9, 6], [230, 13], 0)
    assert read(table, (3, 4)) is None and read(table, (3, 10**6)) is None
    assert len(table) == 1


def test_rows_nobody_computed_are_skipped():
    table = RecyclingTable(k=2)
    table.update([(1, 5), (5, 6)], rows(([], []), ([7, 8], [0.5, 0.5])))
    assert read(table, (1, 5)) is None and read(table, (5, 6))[0] == [7, 8]


def test_rows_for_fewer_nodes_than_the_contexts_given_are_kept_for_the_nodes_they_cover():
    # a tree ahead is verified less what the verdict before it committed: its verdict has rows for fewer nodes
    table = RecyclingTable(k=2)
    table.update([(1, 5), (5, 6), (6, 7)], rows(([7, 8], [0.5, 0.25]), ([9, 3], [0.5, 0.25])))
    assert read(table, (1, 5))[0] == [7, 8] and read(table, (5, 6))[0] == [9, 3]
    assert read(table, (6, 7)) is None and len(table) == 2


def test_a_hint_beyond_the_tables_vocabulary_is_dropped_and_the_rest_of_its_row_kept():
    table = RecyclingTable(k=3)
    table.update([(1, 5)], rows(([7, 1 << 20, 8], [0.5, 0.3, 0.1])))
    assert read(table, (1, 5)) == ([7, 8], [128, 26], 1)
    assert table.row((1, 5))[0][2] == -1  # no hole: a draft reads a row up to its first empty place


def test_context_rows_are_bounded_and_the_least_recently_updated_go_first(monkeypatch):
    monkeypatch.setattr(recycling, "MAX_CONTEXT_ROWS", 8)
    table = RecyclingTable(k=1)
    for prev in range(8):
        table.update([(prev, 100)], rows(([prev], [1.0])))
    table.update([(0, 100)], rows(([50], [1.0])))  # context (0, 100) is the newest now
    table.update([(8, 100)], rows(([8], [1.0])))  # the ninth context: the older half goes
    kept = {prev for prev in range(9) if read(table, (prev, 100))[2] == 1}
    assert kept == {0, 5, 6, 7, 8}
    assert read(table, (0, 100))[0] == [50] and read(table, (1, 100))[0] == [8]  # 1: the token's row
    for prev in range(9, 40):  # slots are reused: the arrays never grow
        table.update([(prev, 100)], rows(([prev], [1.0])))
    assert len(table._slot) <= 8 and table._context_rows.shape[0] == 8
    assert all(read(table, (p, 100))[0] == [p] for p in range(36, 40))


def grown(recycler: Recycler, draft: DraftTree, context: list[int], max_nodes: int = 16):
    tree, source = recycler.grow(draft, context, max_nodes)
    tree.validate(1000)
    assert all(0 <= p <= 1 for p in tree.accept_probs)
    assert all(tree.accept_probs[i] <= (tree.accept_probs[p] if p >= 0 else 1.0) for i, p in enumerate(tree.parents))
    assert tree.accept_probs == sorted(tree.accept_probs, reverse=True)
    return tree, source


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))}


def test_a_draft_grows_from_the_root_token_and_on_from_every_node():
    recycler = Recycler(k=2)
    # After (.., 1, 2) the target said 3 then 4; after 3, 5; after 5, 6.
    recycler.learn([1, 2], DraftTree([3, 5], [-1, 0]), rows(([3, 4], [0.9, 0.05]), ([5, 9], [0.8, 0.1]),
                                                            ([6, 7], [0.7, 0.2])))
    tree, source = grown(recycler, DraftTree.empty(), [1, 2])
    assert (3, 5, 6) in paths(tree) and tree.tokens[0] == 3 and source == [-1] * len(tree)
    assert min(tree.accept_probs) >= recycling.MIN_PATH


def test_a_small_budget_keeps_the_best_nodes_of_both_sources():
    recycler = Recycler(k=2)
    recycler.learn([1, 2], DraftTree.empty(), rows(([3, 4], [0.95, 0.04])))
    retrieval = DraftTree([7, 8], [-1, 0], accept_probs=[0.3, 0.2])
    tree, source = grown(recycler, retrieval, [1, 2], max_nodes=2)
    assert tree.tokens == [3, 7] and source == [-1, 0]
    tree, source = grown(recycler, retrieval, [1, 2], max_nodes=8)
    assert {(3,), (7,), (7, 8)} <= paths(tree) and sorted(s for s in source if s >= 0) == [0, 1]


def test_a_node_both_sources_propose_is_one_node_with_the_higher_estimate_and_both_learn_from_it():
    recycler = Recycler(k=1)
    recycler.learn([1, 2], DraftTree.empty(), rows(([7], [0.95])))
    retrieval = DraftTree([7], [-1], accept_probs=[0.1])
    tree, source = grown(recycler, retrieval, [1, 2])
    assert tree.tokens.count(7) == 1 and source[tree.tokens.index(7)] == 0
    assert tree.accept_probs[tree.tokens.index(7)] > 0.1
    reached, accepted = reached_and_accepted(tree.parents, [tree.tokens.index(7)])
    recycler.observe(tree.notes, reached, accepted)
    by_two = recycler.calibration[1]  # the row was kept by the context (1, 2)
    assert by_two.reached.sum() == 1 and by_two.accepted.sum() == 1
    assert recycler.calibration[0].reached.sum() == 0


def test_hints_that_keep_failing_are_trusted_less_and_less():
    recycler = Recycler(k=1)
    recycler.learn([1, 2], DraftTree.empty(), rows(([3], [0.6])))
    first = grown(recycler, DraftTree.empty(), [1, 2])[0].accept_probs[0]
    for _ in range(20):
        tree, _ = grown(recycler, DraftTree.empty(), [1, 2])
        recycler.observe(tree.notes, *reached_and_accepted(tree.parents, []))
    later = grown(recycler, DraftTree.empty(), [1, 2])[0]
    assert len(later) == 0 or later.accept_probs[0] < first / 3


def test_a_draft_node_the_target_keeps_rejecting_where_its_row_says_otherwise_is_trusted_less():
    """Retrieval proposes 4 where the table's row (the target's own top tokens after this context) has
    only 3: once verdicts show such nodes fail, their estimates fall; a node the row agrees with does not."""
    recycler = Recycler(k=1)
    recycler.learn([1, 2], DraftTree.empty(), rows(([3], [0.9])))
    retrieval = DraftTree([4, 3], [-1, -1], accept_probs=[0.5, 0.4])
    first, _ = grown(recycler, retrieval, [1, 2])
    assert first.accept_probs[first.tokens.index(4)] == 0.5  # nothing learnt yet: unchanged
    for _ in range(30):
        tree, _ = grown(recycler, retrieval, [1, 2])
        recycler.observe(tree.notes, *reached_and_accepted(tree.parents, [tree.tokens.index(3)]))  # 3 right each time
    later, _ = grown(recycler, retrieval, [1, 2])
    assert later.accept_probs[later.tokens.index(4)] < 0.15
    assert later.accept_probs[later.tokens.index(3)] >= 0.4 and later.tokens[0] == 3


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_draft_and_any_table_grow_into_a_valid_best_first_tree(data):
    """Whatever the draft, the table and what the verdicts taught: a tree (parents first, estimates never
    above the parent's, best first), at most max_nodes nodes, with every draft node it keeps mapped back."""
    vocab = 12
    recycler = Recycler(k=3)
    for _ in range(data.draw(st.integers(0, 6))):
        context = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
        tree = random_draft(data, vocab)
        hints = Hints([data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=3, unique=True))
                       for _ in range(len(tree) + 1)], [])
        hints.probs = [sorted((data.draw(st.floats(0, 1)) for _ in row), reverse=True) for row in hints.ids]
        recycler.learn(context, tree, hints)
        grown_tree, _ = recycler.grow(random_draft(data, vocab), context, 8)
        sent = data.draw(st.integers(0, len(grown_tree)))
        accepted = [i for i in grown_tree.path_to(data.draw(st.integers(0, max(0, sent - 1))))] if sent else []
        recycler.observe(grown_tree.prefix(sent).notes, *reached_and_accepted(grown_tree.parents[:sent], accepted))
    draft = random_draft(data, vocab)
    max_nodes = data.draw(st.integers(1, 20))
    tree, source = grown(recycler, draft, data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4)),
                         max_nodes)
    assert len(tree) <= max(max_nodes, 0)
    for i, s in enumerate(source):
        if s >= 0:
            assert tree.tokens[i] == draft.tokens[s]
            p = tree.parents[i]
            assert (p < 0 and draft.parents[s] < 0) or (p >= 0 and source[p] == draft.parents[s])


def random_draft(data, vocab: int) -> DraftTree:
    """A retrieval-like draft: distinct children, path estimates never above the parent's, best first."""
    tokens, parents, probs, depths = [], [], [], []
    for _ in range(data.draw(st.integers(0, 10))):
        parent = data.draw(st.integers(-1, len(tokens) - 1))
        token = data.draw(st.integers(0, vocab - 1))
        if any(p == parent and t == token for p, t in zip(parents, tokens)):
            continue
        tokens.append(token), parents.append(parent)
        probs.append((1.0 if parent < 0 else probs[parent]) * data.draw(st.floats(0.0, 1.0)))
        depths.append(1 if parent < 0 else depths[parent] + 1)
    order = sorted(range(len(tokens)), key=lambda i: (-probs[i], depths[i], i))  # parents first
    new = {old: k for k, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order], [new[parents[i]] if parents[i] >= 0 else -1 for i in order],
                     accept_probs=[probs[i] for i in order])


SENTENCE = [10, 11, 12, 13, 14, 15]


def test_the_retrieval_drafter_drafts_what_the_verifier_predicted_after_the_same_tokens():
    drafter = RetrievalDrafter(hints_top_k=4)
    drafter.begin([1, 2, 3])
    assert len(drafter.propose()) == 0  # nothing to match, no hints yet
    # The verifier answers a round and tells what it predicts after 3, and after the nodes it was sent.
    tree = DraftTree([40], [-1], accept_probs=[0.5])
    hints = rows(([41, 42], [0.9, 0.05]), ([43], [0.8]))
    drafter.observe(tree, StepResult(tokens=[41], accepted=[], compute_ms=1.0, hints=hints))
    drafter.observe(DraftTree.empty(), StepResult(tokens=[40], accepted=[], compute_ms=1.0))
    assert drafter.propose().tokens[0] == 43  # after 40 the target said 43
    no_hints = RetrievalDrafter(hints_top_k=0)
    assert no_hints.hints_top_k == 0 and no_hints.recycler is None


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(temperature=0.8, seed=3, max_new_tokens=40)],
                         ids=["greedy", "seeded-sampling"])
def test_drafting_from_hints_changes_speed_not_output(params):
    """Greedy: identical tokens. Seeded sampling: the committed token at each position is the one the seed
    draws there, whatever the drafts (cloud/sampling.py, Draws), so it is identical too."""
    hf = tiny_llama(vocab_size=64, seed=2)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=16 << 20, block_size=4)
    prompt = SENTENCE * 2 + [20, 21]
    plain = generate(LocalVerifier(engine).open(prompt, params)).token_ids
    drafter, controller = RetrievalDrafter(hints_top_k=8), TreeSizeController()
    for _ in range(3):  # the table fills across generations, as an SDK client's does
        got = generate(LocalVerifier(engine).open(prompt, params, hints_top_k=8), drafter=drafter,
                       controller=controller)
        assert got.token_ids == plain
    assert len(drafter.recycler.table) > 0
    if params.greedy:
        assert got.rounds < len(plain) / 2  # the table's drafts were accepted
    assert engine.pool.stats().used == 0


def test_the_table_costs_little_memory_per_token_of_vocabulary():
    table = RecyclingTable(k=8)
    table.update([(1, 262_143)], rows((list(range(8)), [0.1] * 8)))
    per_token = table._rows.nbytes / len(table._rows)
    assert per_token == 8 * 4 and table._context_rows.nbytes <= 4 << 20  # a hint in 4 bytes


def test_sampling_with_drafts_from_hints_follows_the_target_distribution():
    """Chi-square, as tests/test_engine_sampling.py does for fixed trees: the first two tokens of thousands
    of seeded generations, each drafted by one retrieval drafter whose recycling table fills from the
    hints of all the generations before it (its drafts depend on the past, never on this pass's draws)."""
    from test_engine_sampling import PROMPT, V, p_value, pair_probs

    target = tiny_llama(vocab_size=V, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    engine = Engine.from_hf_model(target, kv_pool_bytes=64 << 20, block_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    drafter = RetrievalDrafter(hints_top_k=4)
    trials, pairs, drafted_and_taken = 2000, [], 0
    for seed in range(trials):
        session = LocalVerifier(engine).open(PROMPT, replace(params, seed=seed), hints_top_k=4)
        result = generate(session, drafter=drafter, controller=TreeSizeController())
        pairs.append(result.token_ids[:2])
        drafted_and_taken += result.rounds == 1  # both tokens from one pass: a drafted node was accepted
    pairs = np.asarray(pairs)
    probs = pair_probs(target, params)
    assert p_value(pairs[:, 0], probs.sum(1)) > 1e-3
    assert p_value(pairs[:, 0] * V + pairs[:, 1], probs.ravel()) > 1e-3
    assert drafted_and_taken > trials / 4  # the drafts were there and were taken: the test has power
