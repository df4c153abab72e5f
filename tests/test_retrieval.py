"""The retrieval drafter proposes what followed earlier occurrences of the current ending (in the context
and in the long-term datastore), learns from the verifier's answers, and stays lossless in generation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.cloud.engine import Engine
from specedge.cloud.local import LocalVerifier
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge import datastore
from specedge.edge.calibration import judged_by_text, reached_and_accepted
from specedge.edge.controller import TreeSizeController
from specedge.edge.generation import generate
from specedge.edge.retrieval import RetrievalDrafter
from test_pipelined_rounds import trees
from tiny_models import tiny_llama

SENTENCE = [10, 11, 12, 13, 14, 15, 16, 17]


def best_chain(tree: DraftTree) -> list[int]:
    """The tokens of the draft's first root-to-leaf path in best-first order."""
    path, node = [], -1
    while True:
        kids = tree.children()[node + 1]
        if not kids:
            return path
        node = kids[0]
        path.append(tree.tokens[node])


def test_drafts_continue_an_earlier_occurrence_of_the_ending():
    drafter = RetrievalDrafter()
    drafter.begin([1, 2] + SENTENCE + [3, 4] + SENTENCE[:3])
    assert best_chain(drafter.propose())[:5] == SENTENCE[3:8]


def test_the_most_frequent_continuation_ranks_first():
    drafter = RetrievalDrafter()
    drafter.begin([5, 6, 7, 0, 5, 6, 8, 0, 5, 6, 7, 0, 9, 5, 6])
    draft = drafter.propose()
    assert draft.tokens[0] == 7 and draft.parents[0] == -1
    assert 8 in [draft.tokens[c] for c in draft.children()[0]]  # the rarer one is a sibling


def test_nothing_to_match_gives_an_empty_draft():
    drafter = RetrievalDrafter()
    drafter.begin([1, 2, 3, 4, 5])
    assert len(drafter.propose()) == 0


def test_observed_tokens_are_indexed_and_answers_update_the_model():
    drafter = RetrievalDrafter()
    drafter.begin([1] + SENTENCE + [2])
    assert len(drafter.propose()) == 0
    drafter.observe(DraftTree.empty(), StepResult(tokens=SENTENCE[:2], accepted=[], compute_ms=1.0))
    draft = drafter.propose()
    assert best_chain(draft)[:3] == SENTENCE[2:5]
    sent = draft.prefix(3)
    before = draft.accept_probs[0]
    drafter.observe(sent, StepResult(tokens=SENTENCE[2:4] + [99], accepted=[0, 1], compute_ms=1.0))
    assert len(drafter.index) == 1 + len(SENTENCE) + 1 + 2 + 3
    drafter.begin([1] + SENTENCE + [2] + SENTENCE[:2])  # the same situation again: more confident now
    assert drafter.propose().accept_probs[0] > before


def test_a_verdict_is_committed_at_once_and_learned_from_apart():
    """`observe` commits the verdict's tokens, which the next draft needs; what the verdict says of the draft
    is learned by `learn` (called while the next verdict is on its way), or else by the next `observe`."""
    drafter = RetrievalDrafter(hints_top_k=0)
    drafter.begin([1] + SENTENCE + [2] + SENTENCE[:2])
    drafter.observe(drafter.propose().prefix(3), StepResult(tokens=SENTENCE[2:4] + [99], accepted=[0, 1],
                                                            compute_ms=1.0))
    assert drafter.index.tokens[drafter.index.n - 3 : drafter.index.n].tolist() == SENTENCE[2:4] + [99]
    assert drafter.model.reached.sum() == 0
    drafter.learn()
    learned = drafter.model.reached.sum()
    assert learned > 0
    drafter.learn()
    assert drafter.model.reached.sum() == learned  # once
    drafter.observe(DraftTree.empty(), StepResult(tokens=[2], accepted=[], compute_ms=1.0))
    assert drafter.model.reached.sum() == learned  # an empty tree teaches nothing
    drafter.observe(drafter.propose().prefix(2), StepResult(tokens=[98], accepted=[], compute_ms=1.0))
    drafter.observe(DraftTree.empty(), StepResult(tokens=[97], accepted=[], compute_ms=1.0))
    assert drafter.model.reached.sum() > learned  # the verdict before was learned from by this observe


def test_a_generation_whose_drafts_fail_trusts_them_less_until_the_next_prompt():
    drafter = RetrievalDrafter(hints_top_k=0)
    prompt = [1] + SENTENCE + [2] + SENTENCE[:2]
    drafter.begin(prompt)
    for k in range(3):  # the text goes elsewhere: every draft is rejected at its first token
        drafter.observe(drafter.propose().prefix(3), StepResult(tokens=[90 + k], accepted=[], compute_ms=1.0))
        drafter.index.append(SENTENCE[:2])  # the same ending again, so the same draft
    assert drafter.model.generation.value < 0
    lowered = drafter.propose().accept_probs[0]
    drafter.begin(drafter.index.tokens[: drafter.index.n].tolist())  # a new prompt, the same text
    assert drafter.model.generation.value == 0
    assert drafter.propose().accept_probs[0] > lowered


def greedy_verdict(tree: DraftTree, text: list[int]) -> tuple[list[int], list[int]]:
    """A greedy verifier whose model goes on with `text`: the accepted nodes, and the tokens committed."""
    accepted, node = [], -1
    while (node := next((c for c in tree.children()[node + 1] if tree.tokens[c] == text[len(accepted)]),
                        None)) is not None:
        accepted.append(node)
    return accepted, text[: len(accepted) + 1]


@settings(max_examples=300, deadline=None)
@given(tree=trees(), sent=st.integers(0, 24), text=st.lists(st.integers(0, 5), min_size=26, max_size=26))
def test_in_greedy_generations_the_committed_text_judges_unsent_nodes_as_sending_them_would(tree, sent, text):
    _, committed = greedy_verdict(tree.prefix(sent), text)
    reached, accepted = reached_and_accepted(tree.parents, greedy_verdict(tree, text)[0])
    judged = np.array(tree.depths(), dtype=np.int64) <= len(committed)  # deeper: the text says nothing
    assert (judged_by_text(tree, committed)[0] == reached & judged).all()
    assert (judged_by_text(tree, committed)[1] == accepted & judged).all()


def test_a_greedy_generation_learns_from_the_nodes_it_did_not_send():
    drafter = RetrievalDrafter(hints_top_k=0)
    prompt = [1] + SENTENCE + [2, 10, 11, 3, 4, 10, 11]  # after 10 11: 12 or 3

    def estimates() -> dict[int, float]:
        """The acceptance estimate of each token the draft offers first."""
        draft = drafter.propose()
        return {draft.tokens[i]: draft.accept_probs[i] for i in draft.children()[0]}

    drafter.begin(prompt)
    draft = drafter.propose()
    first, runner_up = (draft.tokens[i] for i in draft.children()[0])
    before = estimates()
    drafter.observe(draft.prefix(1), StepResult(tokens=[runner_up], accepted=[], compute_ms=1.0))  # not sent
    drafter.begin(prompt)  # the same situation again: the runner-up is trusted more, the first choice less
    after = estimates()
    assert after[runner_up] > before[runner_up] and after[first] < before[first]
    drafter.begin(prompt, SamplingParams(temperature=1.0))  # sampled text does not judge unsent nodes
    drafter.observe(drafter.propose().prefix(0), StepResult(tokens=[runner_up], accepted=[], compute_ms=1.0))
    drafter.begin(prompt)
    assert estimates()[runner_up] == pytest.approx(after[runner_up])


def test_earlier_outputs_supply_continuations_the_context_lacks():
    drafter = RetrievalDrafter()
    drafter.begin([1, 2, 3])
    drafter.observe(DraftTree.empty(), StepResult(tokens=SENTENCE, accepted=[], compute_ms=1.0))
    drafter.end()
    drafter.begin([4, 5, 6] + SENTENCE[:3])  # a new prompt that starts what the last answer said
    assert best_chain(drafter.propose()) == SENTENCE[3:]  # and not past that answer's end
    drafter.end()
    drafter.begin([4, 5, 6, 7])
    assert len(drafter.propose()) == 0  # nothing earlier ends like this


def test_the_long_term_datastore_supplies_continuations_the_context_lacks(tmp_path):
    datastore.build([[40, 41, 42, 43, 44, 45], [7, 7, 7]], tmp_path, "fp", ["doc"])
    drafter = RetrievalDrafter(datastore=datastore.Datastore(tmp_path))
    drafter.begin([1, 2, 40, 41, 42])
    draft = drafter.propose()
    assert best_chain(draft) == [43, 44, 45]  # and not past the end of the document


def test_the_controller_sends_nothing_for_weak_drafts_and_more_for_strong_ones():
    cost = CostModel(((0, 50.0), (4, 68.0), (16, 110.0), (64, 250.0)))  # as measured on this CPU
    def chain(accept_probs):
        return DraftTree(list(range(20)), list(range(-1, 19)), accept_probs=accept_probs)

    controller = TreeSizeController(max_nodes=16)
    assert controller.choose(chain([0.05 * 0.5**i for i in range(20)]), cost, remaining=100) == 0
    strong = controller.choose(chain([0.95**i for i in range(1, 21)]), cost, remaining=100)
    assert 4 <= strong <= 16
    assert controller.choose(chain([0.95**i for i in range(1, 21)]), cost, remaining=2) <= 2
    assert controller.choose(chain(None), cost, remaining=100) == 16  # no estimates: the drafter's size


@pytest.mark.parametrize("seed", range(3))
def test_greedy_generation_with_retrieval_drafts_equals_plain_decoding(seed):
    hf = tiny_llama(vocab_size=64, seed=seed)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=8 << 20, block_size=4)
    verifier = LocalVerifier(engine)
    prompt = [3, 4, 5, 6, 7, 8] * 6 + [3, 4]  # repetitive, so retrieval has plenty to propose
    params = SamplingParams(max_new_tokens=40)
    plain = generate(verifier.open(prompt, params))
    drafter = RetrievalDrafter()
    spec = generate(verifier.open(prompt, params), drafter=drafter, controller=TreeSizeController())
    assert spec.token_ids == plain.token_ids
    assert sum(spec.tree_sizes) > 0  # drafts were really sent
    assert engine.pool.stats().used == 0
