"""The verifier's own draft for a tree ahead with nothing left (cloud/verifier_drafter.py): the edge's
retrieval drafter over the session's text, cut by the verifier's cost model and by the room it is given;
and what it keeps of a client's sessions for the next ones (WarmDrafters). The protocol around it (the
verdict, the budget, lossless output, the served verifier keeping it) is in tests/test_pipelined_rounds.py."""

from __future__ import annotations

from specedge.cloud.acceptance import Verdict
from specedge.cloud.verifier_drafter import VerifierDrafter, WarmDrafters, client_share
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams

PHRASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
FLAT = CostModel(((0, 20.0), (64, 20.0)))  # a GPU-like pass: nodes cost nothing while the step is small
STEEP = CostModel(((0, 20.0), (64, 660.0)))  # 10 ms a node on a 20 ms pass: only sure nodes pay


def drafter_after(text: list[int]) -> VerifierDrafter:
    return VerifierDrafter(text, SamplingParams(max_new_tokens=100), hints_top_k=0)


def test_it_drafts_what_followed_the_texts_ending_before_within_the_room_given():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    draft = drafter.draft(6, FLAT).tree
    assert 0 < len(draft) <= 6
    assert draft.tokens[0] == PHRASE[3] and draft.parents[0] == -1
    assert drafter.draft(0, FLAT).tree.tokens == []


def test_a_costly_node_is_left_out_where_a_cheap_one_is_sent():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    assert len(drafter.draft(16, STEEP).tree) < len(drafter.draft(16, FLAT).tree)


def test_a_text_whose_ending_never_occurred_before_gets_no_draft():
    assert len(drafter_after(list(range(1, 40))).draft(16, FLAT).tree) == 0


def test_it_follows_the_committed_text_from_verdict_to_verdict():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4])
    first = drafter.draft(8, FLAT).tree
    drafter.observe(first, Verdict(accepted=[], tokens=[PHRASE[0]], bonus=PHRASE[0]))
    assert drafter.draft(8, FLAT).tree.tokens[:2] == PHRASE[1:3]


def session_of(warm: WarmDrafters, client: str, prompt: list[int], generated: list[int] = ()) -> VerifierDrafter:
    return VerifierDrafter(prompt, SamplingParams(max_new_tokens=100), 0, generated, warm, client)


def test_a_clients_next_session_drafts_from_what_its_earlier_sessions_committed():
    warm = WarmDrafters(clients=4)
    first = session_of(warm, "a", [1, 2], generated=[3] + PHRASE)  # the output before the first fill counts too
    first.observe(DraftTree.empty(), Verdict(accepted=[], tokens=[4], bonus=4))
    first.end()
    draft = session_of(warm, "a", [7, 8] + PHRASE[:3]).draft(8, FLAT).tree  # a new prompt that starts that output
    assert draft.tokens[:3] == PHRASE[3:6]
    assert len(session_of(warm, "b", [7, 8] + PHRASE[:3]).draft(8, FLAT).tree) == 0  # another client's is its own
    cold = VerifierDrafter([7, 8] + PHRASE[:3], SamplingParams(max_new_tokens=100), hints_top_k=0)
    assert len(cold.draft(8, FLAT).tree) == 0


def test_what_the_verdicts_taught_carries_over_and_nothing_is_kept_when_turned_off():
    warm = WarmDrafters(clients=4)
    first = session_of(warm, "a", [1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    for token in PHRASE[3:8]:  # drafts that always come true
        first.observe(first.draft(1, FLAT).tree, Verdict(accepted=[0], tokens=[token, token], bonus=token))
    taught = first.drafter.model
    assert taught.reached.sum() > 0
    first.end()
    assert session_of(warm, "a", [5]).drafter.model is taught
    off = WarmDrafters(clients=0)
    session = session_of(off, "a", [1, 2], PHRASE)
    session.end()
    assert len(off) == 0 and session_of(off, "a", [5]).drafter.model is not session.drafter.model


def test_a_second_session_of_a_client_at_the_same_time_starts_fresh():
    warm = WarmDrafters(clients=4)
    done = session_of(warm, "a", [1, 2], PHRASE)
    done.end()
    running = session_of(warm, "a", [5])  # takes what `done` left
    assert running.drafter.history.n > 0
    beside = session_of(warm, "a", [6])
    assert beside.drafter.history.n == 0 and beside.drafter.model is not running.drafter.model


def test_only_the_clients_served_last_are_kept_each_with_a_bounded_history():
    warm = WarmDrafters(clients=2, history_tokens=64)
    for client in ("a", "b", "c"):
        for _ in range(5):  # 5 outputs of 20 tokens: more than 64 in all
            session = session_of(warm, client, [1], list(range(100, 120)))
            session.end()
    assert len(warm) == 2
    assert session_of(warm, "a", [1]).drafter.history.n == 0  # served first: forgotten
    assert 0 < session_of(warm, "c", [1]).drafter.history.n <= 64 + 21


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]


def test_a_tree_ahead_with_nodes_left_keeps_them_and_gets_the_verifiers_draft_below_and_beside_them_best_first():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])  # its draft: PHRASE[3:], ...
    left = DraftTree([PHRASE[3], 99, 98], [-1, 0, -1], accept_probs=[0.9, 0.4, 0.05])
    filled = drafter.draft(8, FLAT, left)
    merged = filled.tree
    merged.validate(vocab_size=200)
    assert 3 < len(merged) <= 8
    for i, at in enumerate(filled.client_nodes):  # the client's nodes, each with its path and estimate
        assert paths(merged)[at] == paths(left)[i] and merged.accept_probs[at] == left.accept_probs[i]
    assert (PHRASE[3], PHRASE[4]) in paths(merged)  # below the client's PHRASE[3], which is not there twice
    assert len(set(paths(merged))) == len(merged)
    probs = merged.accept_probs  # best first, and a path's estimate never above its parent's
    assert probs == sorted(probs, reverse=True)
    assert all(p <= probs[parent] for p, parent in zip(probs, merged.parents) if parent >= 0)
    assert len(drafter.draft(8, FLAT, left, max_depth=1).tree) == 3  # its only node that shallow is the client's
    assert drafter.draft(3, FLAT, left).tree is left  # no room left
    sampled = DraftTree([PHRASE[3]], [-1], {-1: ([PHRASE[3], 99], [0.5, 0.5])}, [0.5])
    assert drafter.draft(8, FLAT, sampled).tree is sampled  # a sampled draft's parent takes only its proposal
    unpriced = DraftTree([PHRASE[3]], [-1])
    assert drafter.draft(8, FLAT, unpriced).tree is unpriced


def test_it_learns_from_its_own_nodes_in_a_tree_it_added_to_and_the_client_reads_its_own():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    left = DraftTree([99, PHRASE[3]], [-1, -1], accept_probs=[0.05, 0.9])  # (not best first: the client's order)
    filled = drafter.draft(8, FLAT, left)
    merged, (wrong, right) = filled.tree, filled.client_nodes
    below = paths(merged).index((PHRASE[3], PHRASE[4]))
    path = [right, below]
    hints = Hints([[t] for t in range(len(merged) + 1)], [[1.0]] * (len(merged) + 1))
    drafter.observe(merged, Verdict(path, PHRASE[3:6], PHRASE[5], hints))
    drafter.drafter.learn()  # (else at the next verdict)
    assert drafter.drafter.model.reached.sum() > 0  # its draft's nodes, the client's PHRASE[3] among them
    index = drafter.drafter.index
    assert index.tokens[index.n - 3 : index.n].tolist() == PHRASE[3:6]
    accepted, read, drafted = client_share(path, hints, filled.client_nodes)
    assert (accepted, drafted, read.ids) == ([1], 1, [[0], [1 + wrong], [1 + right]])


def test_where_a_loaded_step_verified_only_the_first_nodes_the_client_gets_its_rows_up_to_the_first_missing():
    """Hints travel as rows of equal length (common/wire.py), so a row the pass did not compute ends them, as
    it does for a client's tree that a step's plan cut."""
    hints = Hints([[0], [1], [2]], [[1.0]] * 3)  # the root's and the first two nodes' of a 4-node tree
    accepted, read, drafted = client_share([1], hints, [1, 3, 0])
    assert (accepted, drafted, read.ids) == ([0], 0, [[0], [2]])
