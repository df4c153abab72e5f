"""The verifier's own draft for a tree sent ahead, and what it keeps per client.

A tree sent ahead of the verdict in flight (edge pipelining over a long round trip) was drafted before the
edge knew that verdict's last (bonus) token. Mostly it does not spell it, so nothing of it is left, and the
pass would commit one token; where something is left, it is what the edge could guess a verdict early. The
verifier knows that token as it builds the pass, so where the client asks (`DraftTree.fill_tokens`) it adds
its own draft to what is left (all of the draft where nothing is), with the edge's retrieval drafter over
the session's own text (prompt and output) and the target's predictions it has computed for the session
(hints, where the session asked for them), sized by its own cost model. The tree is verified like any
other, so the output does not change; only how many tokens such a pass commits does.

Over a long round trip most rounds have nothing of the edge's tree left (72-78% at 80 ms by timed replay,
BENCHMARKS.md section 8), so the verifier's drafter carries much of a client's speed. A fresh one starts
each session with a cautious acceptance model and no earlier outputs; `WarmDrafters` keeps both per client
for its next sessions, as the edge keeps its own (by the same replay, 4.1% more per prompt at 80 ms than
fresh ones).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from specedge.cloud.acceptance import Verdict
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import best_tree_size
from specedge.edge.acceptance_model import AcceptanceModel
from specedge.edge.context_index import ContextIndex
from specedge.edge.retrieval import RetrievalDrafter

WARM_HISTORY_TOKENS = 8192  # earlier outputs kept per client (1.7 MiB held at most, measured on random text)


@dataclass
class Filled:
    """A tree ahead as the verifier verifies it: the client's nodes left and its own draft's, best first."""

    tree: DraftTree
    client_nodes: list[int]  # each of the client's nodes' index in `tree`


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
        # The tree `draft` returned last and its own draft's nodes in it (for `observe`): (merged, (those
        # nodes as a tree of their own, each one's index in merged)).
        self._mine: tuple[DraftTree, tuple[DraftTree, list[int]]] | None = None

    def draft(self, max_tokens: int, cost: CostModel, left: DraftTree | None = None, max_depth: int | None = None
              ) -> Filled:
        """`left` (what is left of the client's tree, kept whole) and below the committed text the nodes of
        this drafter's best-first draft that it lacks, as many as pay for the time they add to the pass (the
        verifier is what a pipelined client waits on: no round trip to amortise), `max_tokens` nodes in all,
        none of those added deeper than `max_depth`; all best first, as a loaded step's plan takes them
        (cloud/step_plan.py). A tree ahead that the verdict before it left something of was still drafted
        without that verdict's last token, which this draft knows. Nothing is added below a client's sampled
        drafts (their proposals are the whole of what the rejection sampling at their parents may take) nor
        to a tree without acceptance estimates to price it by."""
        left = left if left is not None else DraftTree.empty()
        self._mine = None
        as_sent = Filled(left, list(range(len(left))))
        if max_tokens <= len(left) or left.proposals or (len(left) and left.accept_probs is None):
            return as_sent
        own = self.drafter.propose()
        if not own.accept_probs:  # (none: nothing to price it by, nothing added)
            return as_sent
        tokens, parents, probs, where = _added(left, own, max_tokens, max_depth)
        # Priced with what the client's nodes promise (their estimates, given the path committed) as the base.
        n = best_tree_size(probs[len(left) :], cost.table(len(tokens))[len(left) :], base=1.0 + sum(probs[: len(left)]))
        kept = len(left) + n
        # Best first: a parent's estimate is never below its child's, and on a tie the parent comes first.
        order = sorted(range(kept), key=lambda i: (-probs[i], i))
        new = {old: i for i, old in enumerate(order)}
        merged = DraftTree([tokens[i] for i in order], [new[parents[i]] if parents[i] >= 0 else -1 for i in order],
                           None, [probs[i] for i in order])
        self._mine = merged, _sent_of(own, [new[w] if w is not None and w < kept else None for w in where])
        return Filled(merged, [new[i] for i in range(len(left))])

    def observe(self, tree: DraftTree, verdict: Verdict) -> None:
        """The verdict on `tree` (the session's, or the last one `draft` returned), committed. Of a tree this
        drafter added to, it learns from its own draft's nodes: those the tree has, sent or not."""
        if self._mine is not None and self._mine[0] is tree:
            tree, index = self._mine[1]
            verdict = Verdict(_path_within(verdict.accepted, index), verdict.tokens, verdict.bonus,
                              _rows(verdict.hints, index))
        self._mine = None
        self.drafter.observe(tree, StepResult(verdict.tokens, verdict.accepted, 0.0, hints=verdict.hints))

    def end(self) -> None:
        """The session is over: its output and what the verdicts taught go to the client's next sessions."""
        if self.warm is not None:
            self.drafter.end()
            self.warm.give_back(self.client, self.drafter)


def client_share(accepted: list[int], hints: Hints | None, client_nodes: list[int]
                 ) -> tuple[list[int], Hints | None, int]:
    """Of a verdict on a tree that holds the client's nodes left (`client_nodes`: each one's index in it) and
    the verifier's own draft (`VerifierDrafter.draft`), what the client reads: its own accepted nodes, the
    hints of the root and its own nodes, and how many of the committed tokens the verifier drafted."""
    own = _path_within(accepted, client_nodes)
    return own, _rows(hints, client_nodes), len(accepted) - len(own)


def _added(left: DraftTree, draft: DraftTree, max_tokens: int, max_depth: int | None
           ) -> tuple[list[int], list[int], list[float], list[int | None]]:
    """`left`'s nodes, then `draft`'s that it lacks, in `draft`'s order, within `max_tokens` nodes in all and
    `max_depth`: (tokens, parents, estimates, each of `draft`'s nodes' index among them or None). An added
    node's estimate is capped at its parent's (a path's estimate), whoever drafted the parent."""
    tokens, parents, probs = list(left.tokens), list(left.parents), list(left.accept_probs or ())
    node = {(parent, token): i for i, (token, parent) in enumerate(zip(left.tokens, left.parents))}
    depth, where = left.depths(), []
    for token, parent, p in zip(draft.tokens, draft.parents, draft.accept_probs):
        above = where[parent] if parent >= 0 else -1
        if above is None or (above, token) in node:
            where.append(None if above is None else node[(above, token)])
            continue
        d = depth[above] + 1 if above >= 0 else 1
        if len(tokens) >= max_tokens or (max_depth is not None and d > max_depth):
            where.append(None)
            continue
        where.append(len(tokens))
        node[(above, token)] = len(tokens)
        tokens.append(token)
        parents.append(above)
        depth.append(d)
        probs.append(min(p, probs[above]) if above >= 0 else p)
    return tokens, parents, probs, where


def _path_within(accepted: list[int], nodes: list[int]) -> list[int]:
    """The accepted path's first nodes that are among `nodes` (indices in the tree verified), as indices into
    `nodes`. (Below a node not among them none is: `nodes` holds each one's parent.)"""
    at = {node: i for i, node in enumerate(nodes)}
    return [at[i] for i in itertools.takewhile(lambda i: i in at, accepted)]


def _rows(hints: Hints | None, nodes: list[int]) -> Hints | None:
    """The hints of the root and of `nodes` (indices in the tree), in that order, up to the first node the
    pass did not compute (a loaded step's plan may verify only the tree's first nodes; as for a client's
    tree cut by it, the rows after are missing, not empty)."""
    if hints is None:
        return None
    rows = list(itertools.takewhile(lambda r: r < len(hints), [0] + [1 + node for node in nodes]))
    return Hints([hints.ids[r] for r in rows], [hints.probs[r] for r in rows])


def _sent_of(draft: DraftTree, where: list[int | None]) -> tuple[DraftTree, list[int]]:
    """The nodes of `draft` that a merged tree has (`where`: each node's index there, None where it has not;
    a node's parent is there wherever the node is) as a tree of their own with their estimates and notes,
    its whole draft `draft`, and each one's index in the merged tree."""
    kept = [i for i, w in enumerate(where) if w is not None]
    new = {old: i for i, old in enumerate(kept)}
    parents = [new[draft.parents[i]] if draft.parents[i] >= 0 else -1 for i in kept]
    tree = DraftTree([draft.tokens[i] for i in kept], parents, None,
                     None if draft.accept_probs is None else [draft.accept_probs[i] for i in kept],
                     None if draft.notes is None else [draft.notes[i] for i in kept],
                     draft.drafted if draft.drafted is not None else draft)
    return tree, [where[i] for i in kept]


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
