"""The verifier's own draft for a round whose tree has nothing left to verify.

A tree sent ahead of the verdict in flight (edge pipelining over a long round trip) was drafted before the
edge knew that verdict's last (bonus) token. Mostly it does not spell it, so nothing of it is left, and the
pass would commit one token. The verifier knows that token as it builds the pass, so where the client asks
(`DraftTree.fill_tokens`) it drafts there itself, with the edge's retrieval drafter over the session's own
text (prompt and output) and the target's predictions it has computed for the session (hints, where the
session asked for them), sized by its own cost model. The draft is verified like any other, so the output
does not change; only how many tokens such a pass commits does.
"""

from __future__ import annotations

from specedge.cloud.acceptance import Verdict
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import best_tree_size
from specedge.edge.retrieval import RetrievalDrafter


class VerifierDrafter:
    """One session's drafter on the verifier, from the first round that asks to be filled on: it sees every
    verdict from then on (its tokens, and its hints where the session has them)."""

    def __init__(self, committed: list[int], params: SamplingParams, hints_top_k: int) -> None:
        self.drafter = RetrievalDrafter(hints_top_k=hints_top_k)
        self.drafter.begin(committed, params)

    def draft(self, max_tokens: int, cost: CostModel) -> DraftTree:
        """The best-first draft after the committed text, cut where another node no longer pays for the time
        it adds to the pass (the verifier is what a pipelined client waits on: no round trip to amortise)."""
        if max_tokens <= 0:
            return DraftTree.empty()
        draft = self.drafter.propose()
        probs = (draft.accept_probs or [])[:max_tokens]  # (none: nothing to price it by, nothing sent)
        return draft.prefix(best_tree_size(probs, cost.table(len(probs))))

    def observe(self, tree: DraftTree, verdict: Verdict) -> None:
        """The verdict on `tree` (the session's or this drafter's), committed."""
        self.drafter.observe(tree, StepResult(verdict.tokens, verdict.accepted, 0.0, hints=verdict.hints))
