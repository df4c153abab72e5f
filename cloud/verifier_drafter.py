"""The verifier's own draft for a round whose tree has nothing left to verify, and what it keeps per client.

A tree sent ahead of the verdict in flight (edge pipelining over a long round trip) was drafted before the
edge knew that verdict's last (bonus) token. Mostly it does not spell it, so nothing of it is left, and the
pass would commit one token. The verifier knows that token as it builds the pass, so where the client asks
(`DraftTree.fill_tokens`) it drafts there itself, with the edge's retrieval drafter over the session's own
text (prompt and output) and the target's predictions it has computed for the session (hints, where the
session asked for them), sized by its own cost model. The draft is verified like any other, so the output
does not change; only how many tokens such a pass commits does.

Over a long round trip most rounds are such rounds (72-78% at 80 ms by timed replay, BENCHMARKS.md section 8),
so the verifier's drafter carries much of a client's speed. A fresh one starts each session with a cautious
acceptance model and no earlier outputs; `WarmDrafters` keeps both per client for its next sessions, as the
edge keeps its own (by the same replay, 4.1% more per prompt at 80 ms than fresh ones).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from specedge.cloud.acceptance import Verdict
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import best_tree_size
from specedge.edge.acceptance_model import AcceptanceModel
from specedge.edge.context_index import ContextIndex
from specedge.edge.retrieval import RetrievalDrafter

WARM_HISTORY_TOKENS = 8192  # earlier outputs kept per client (1.7 MiB held at most, measured on random text)


class VerifierDrafter:
    """One session's drafter on the verifier, from the first round that asks to be filled on: it sees every
    verdict from then on (its tokens, and its hints where the session has them)."""

    def __init__(self, prompt: list[int], params: SamplingParams, hints_top_k: int, generated: list[int] = (),
                 warm: WarmDrafters | None = None, client: str = "") -> None:
        """`generated`: the output committed so far; `warm`: where the client's drafting state from its earlier
        sessions is kept (None: start fresh, keep nothing)."""
        self.warm, self.client = warm, client
        self.drafter = warm.take(client, hints_top_k) if warm is not None else RetrievalDrafter(hints_top_k=hints_top_k)
        self.drafter.begin(list(prompt), params)
        self.drafter.index.append(list(generated))

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

    def end(self) -> None:
        """The session is over: its output and what the verdicts taught go to the client's next sessions."""
        if self.warm is not None:
            self.drafter.end()
            self.warm.give_back(self.client, self.drafter)


@dataclass
class _Kept:
    model: AcceptanceModel
    history: ContextIndex


class WarmDrafters:
    """Per client, the verifier's drafting state from its last session: the acceptance model and the earlier
    outputs (not the hints table, vocabulary-sized). A session takes its client's state for its own (a second
    session of the client at the same time starts fresh) and gives it back at its end. Kept for the `clients`
    served last; 0 keeps nothing."""

    def __init__(self, clients: int, history_tokens: int = WARM_HISTORY_TOKENS) -> None:
        self.clients, self.history_tokens = clients, history_tokens
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, client: str, hints_top_k: int) -> RetrievalDrafter:
        kept = self._kept.pop(client, None)
        drafter = RetrievalDrafter(hints_top_k=hints_top_k, model=kept.model if kept else None,
                                   history_tokens=self.history_tokens)
        if kept is not None:
            drafter.history = kept.history
        return drafter

    def give_back(self, client: str, drafter: RetrievalDrafter) -> None:
        if self.clients <= 0:
            return
        self._kept[client] = _Kept(drafter.model, drafter.history)
        self._kept.move_to_end(client)
        while len(self._kept) > self.clients:
            self._kept.popitem(last=False)
