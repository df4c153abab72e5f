"""The verifier's own draft for a tree ahead with nothing left (cloud/verifier_drafter.py): the edge's
retrieval drafter over the session's text, cut by the verifier's cost model and by the room it is given.
The protocol around it (the verdict, the budget, lossless output) is in tests/test_pipelined_rounds.py."""

from __future__ import annotations

from specedge.cloud.acceptance import Verdict
from specedge.cloud.verifier_drafter import VerifierDrafter
from specedge.common.cost_model import CostModel
from specedge.common.params import SamplingParams

PHRASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
FLAT = CostModel(((0, 20.0), (64, 20.0)))  # a GPU-like pass: nodes cost nothing while the step is small
STEEP = CostModel(((0, 20.0), (64, 660.0)))  # 10 ms a node on a 20 ms pass: only sure nodes pay


def drafter_after(text: list[int]) -> VerifierDrafter:
    return VerifierDrafter(text, SamplingParams(max_new_tokens=100), hints_top_k=0)


def test_it_drafts_what_followed_the_texts_ending_before_within_the_room_given():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    draft = drafter.draft(6, FLAT)
    assert 0 < len(draft) <= 6
    assert draft.tokens[0] == PHRASE[3] and draft.parents[0] == -1
    assert drafter.draft(0, FLAT).tokens == []


def test_a_costly_node_is_left_out_where_a_cheap_one_is_sent():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4] + PHRASE[:3])
    assert len(drafter.draft(16, STEEP)) < len(drafter.draft(16, FLAT))


def test_a_text_whose_ending_never_occurred_before_gets_no_draft():
    assert len(drafter_after(list(range(1, 40))).draft(16, FLAT)) == 0


def test_it_follows_the_committed_text_from_verdict_to_verdict():
    drafter = drafter_after([1, 2] + PHRASE + [3, 4])
    first = drafter.draft(8, FLAT)
    drafter.observe(first, Verdict(accepted=[], tokens=[PHRASE[0]], bonus=PHRASE[0]))
    assert drafter.draft(8, FLAT).tokens[:2] == PHRASE[1:3]
