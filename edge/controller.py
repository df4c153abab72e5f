"""How many draft nodes to send: the prefix of the best-first draft that maximises expected committed
tokens per second, given the verifier's cost model and the time a round costs besides the pass;
whether to send a second tree ahead of the verdict in flight over a long round trip; and how many trees to
keep in flight where the round trip is several passes long."""

from __future__ import annotations

import math

import numpy as np

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES, best_tree_size


MAX_IN_FLIGHT = 64  # trees in flight at most (TreeSizeController.depth), for round trips of 63 passes and more
# A tree ahead must promise this much more than waiting: while it is in flight, a draft made after the verdict
# before it (which may find far more once that verdict's tokens are known) waits a pass longer.
AHEAD_MARGIN = 1.1
FILL_ALPHA = 0.1  # weight of the latest value in the recent means of the verifier's drafts and the promises
# Means of tokens below this are too little to divide by: a ratio divides by this instead, and is 1 where what
# was committed is below it too (nothing learned). Divided by 1e-9, waits priced at nothing (a draft with nothing
# below its path) that committed nothing scaled every later wait to nothing, and at 0 ms trees went ahead.
MIN_PRICED = 0.05


def _mean(mean: float | None, value: float, alpha: float) -> float:
    """An exponential moving mean; the first value starts it."""
    return float(value) if mean is None else mean + alpha * (value - mean)


def _ratio(committed: float | None, priced: float | None) -> float:
    """What was committed against what it was priced at, by their recent means (1 before any, and while both
    are below MIN_PRICED)."""
    if committed is None or max(committed, priced) < MIN_PRICED:
        return 1.0
    return committed / max(priced, MIN_PRICED)


class TreeSizeController:
    def __init__(self, max_nodes: int = MAX_TREE_NODES, overhead_ms: float = 0.0, alpha: float = 0.3,
                 fixed: int | None = None, overlap: bool = True, fill: bool = True,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """`fixed`: always send this many nodes (as many as the draft has, within the caps) instead of the
        expected-value choice: the fixed sizes that experiments compare the choice with. `overlap`: send a
        tree ahead of the verdict in flight where that pays (see `ahead`). `fill`: let the verifier add its own
        draft to what is left of a tree ahead once the verdict before it is known, all of it where nothing is
        left (cloud/verifier_drafter.py: it knows that verdict's last token, which the edge could not).
        `max_in_flight`: trees in flight at most (`depth`; 2: one ahead of the verdict awaited, never more)."""
        self.max_nodes = max_nodes
        self.fixed = fixed
        self.overlap = overlap
        self.fill = fill
        self.max_in_flight = max(2, min(max_in_flight, MAX_IN_FLIGHT))
        # Recent means of what the verifier's drafts committed per filled pass and of what this edge's drafts
        # promised at each choice whether to go ahead: their ratio scales the worth of a bare tree ahead.
        self._filled: float | None = None
        self._promised: float | None = None
        self._filled_nodes: float | None = None  # recent mean of the nodes the verifier drafted for a bare tree
        # Recent means of what the trees sent after a wait committed and of what waiting was priced at then,
        # for drafts made beyond a path: their ratio scales the price of waiting. That price is a draft made
        # before the verdict awaited, which the draft after it may not match: a model drafter's nodes, computed
        # beyond where that verdict was thought to end, are mostly gone once the verifier's own draft has moved
        # the end on. (A fresh draft, retrieval's, is priced as before: scaled, it went ahead at 0 ms.)
        self._waits_committed: float | None = None
        self._waits_priced: float | None = None
        self._wait_priced: float | None = None  # the wait decided last's price, until its tree is chosen
        self._awaited: float | None = None  # the price of the wait before the tree chosen last, until its verdict
        self.overhead_ms = overhead_ms  # per round besides the pass: network round trip, queueing, drafting
        self.alpha = alpha
        self.server_cap: int | None = None  # the largest tree the verifier said it will take next

    def begin(self) -> None:
        """A generation starts: a wait decided in the last one, where its last verdict came before a tree
        followed, prices nothing here. (What was learned stays: the means, the round's overhead, the cap.)"""
        self._wait_priced = self._awaited = None

    def choose(self, draft: DraftTree, cost: CostModel, remaining: int) -> int:
        """Number of leading draft nodes to send (0 = just let the verifier decode one token)."""
        self._awaited, self._wait_priced = self._wait_priced, None
        return self._size(draft, cost, remaining)

    def _size(self, draft: DraftTree, cost: CostModel, remaining: int) -> int:
        cap = self.max_nodes if self.server_cap is None else min(self.max_nodes, self.server_cap)
        if self.fixed is not None:
            return min(self.fixed, len(draft), cap)
        if draft.accept_probs is None:  # the drafter cannot estimate: trust its own size
            return min(len(draft), cap)
        probs = draft.accept_probs[:cap]
        return best_tree_size(probs, cost.table(len(probs)), overhead_ms=self.overhead_ms, most_tokens=remaining)

    def ahead(self, draft: DraftTree, cost: CostModel, remaining: int, covered: int, beyond: bool = False
              ) -> int | None:
        """Nodes of `draft` to send ahead of the verdict in flight (None: wait for it instead). The verifier
        verifies what is left of them once that verdict is committed and answers a pass after it, where
        waiting would answer a round trip and a pass after it: a tree ahead keeps the verifier busy during
        the round trip but is drafted a verdict earlier, so it is worth less. The first `covered` nodes
        stand for what the verdict in flight may commit; the nodes below them are what the tree ahead adds.

        Both ways are priced in expected committed tokens per millisecond. Waiting: the tree `choose` sends, a round
        trip and its pass later (for a draft beyond a path, its promise scaled by what the trees sent after such
        waits have lately committed against it). Ahead: one token (the pass's own) plus the nodes below the covered
        ones that the verdict in flight cannot commit itself (a child of a covered node would be its bonus token),
        every pass or every half round trip and pass, whichever is longer (two trees in flight). Whether to go ahead
        at all is priced as in a pipeline under way, where a tree covers only what is left of the one before it
        after a verdict, which is little (as if nothing were covered), and must beat waiting by AHEAD_MARGIN; how
        many nodes go, by what this tree does cover. (`beyond`: the draft was made beyond the covered nodes, the
        likeliest path of the tree in flight, as a model drafter makes it (edge/generation.py): then what it covers
        is known, and the choice is priced by it.) Where the verifier drafts for a tree with nothing left (`fill`),
        such a tree is worth its pass's token plus what that draft commits: what this one promises (the verifier
        drafts from the same text, by the same rule, knowing one token more), scaled by what the verifier's drafts
        have lately committed against such promises (under load it sizes them down; in a new session its estimates
        start from priors), its pass that of the nodes the verifier has lately drafted for one."""
        if not self.overlap:
            return None
        # What waiting would send: this draft, or where it was made beyond the covered path, what it drafted
        # below that path (a draft after the verdict starts from about there)
        own = draft.after(draft.tokens[:covered]) if beyond and covered else draft
        if draft.accept_probs is None:  # nothing to price it by: ahead when the trip outlasts the pass
            wait = self._size(own, cost, remaining)
            return min(len(draft), covered + wait) if self.overhead_ms > cost.ms(wait) else None
        waiting, promised, wait = self._waiting(own, cost, remaining)
        scale = self._waits_scale() if beyond else 1.0  # (for a fresh draft, its promise as it stands)
        probs = np.asarray(draft.accept_probs, dtype=np.float64)
        filled = bare = 0.0  # what the verifier's own draft commits for a tree ahead with nothing left; its rate
        if self.fill:
            self._promised = _mean(self._promised, promised, FILL_ALPHA)
            # Before any is measured, the verifier's draft is priced as a wait's (it drafts from the same text):
            # at its promise for a fresh draft, scaled as waiting is for a draft beyond a path.
            filled = promised * (scale if self._filled is None else _ratio(self._filled, self._promised))
            bare = min(remaining, 1.0 + filled) / self._pipelined_ms(cost.ms(self._bare_nodes(wait)))
        # Beyond a path, nothing is left where the verdict does not commit the path whole, and the verifier drafts
        # there: the tree is worth its nodes where the verdict commits the path and the verifier's draft where it
        # does not, both. (Priced as one or the other, the hybrid waited in 8% of its rounds at 80 ms where
        # retrieval waited in 1%, each wait a round trip of the verifier's time: BENCHMARKS.md section 8, "Trees
        # ahead beyond a path priced with the verifier's draft".)
        unfilled = (1.0 - probs[covered - 1]) * filled if beyond and covered else 0.0
        # A draft beyond a path, made before the verdict, is worth no more against its promise than the draft after
        # that verdict has lately committed against it (which knew more): where waiting is scaled down, so are its
        # nodes. (Scaled on one side only, a drafter whose trees after waits committed nothing at a prompt's start
        # priced its nodes ahead at face value against a wait worth its pass's token: at 0 ms, it sent trees ahead
        # where retrieval waited, BENCHMARKS.md section 6, "Trees ahead at 0 ms".)
        probs_ahead = min(1.0, scale) * probs
        ahead = max(self._ahead_rate(draft, probs_ahead, cost, remaining, covered if beyond else 0, unfilled)[1],
                    bare)
        if ahead <= AHEAD_MARGIN * waiting:
            self._wait_priced = promised if beyond else None
            return None
        return covered + self._ahead_rate(draft, probs_ahead, cost, remaining, covered, unfilled)[0]

    def deeper(self, draft: DraftTree, cost: CostModel, remaining: int, covered: int) -> int:
        """Nodes of `draft` to send as a tree beyond the second in flight, where `draft` was made below the likeliest
        path through the trees in flight (its first `covered` nodes). The pipeline keeps the verifier busy either
        way, so a verdict comes every pass: the nodes below the path are priced by their pass alone, against the
        tree with none of them, which the verifier drafts for by itself (`fill`) as for a bare tree (a fixed size
        sends its nodes whatever). With no path covered, the trees before it commit what the draft could not know:
        none of its nodes go."""
        if draft.accept_probs is None or len(draft) <= covered or not covered:
            return covered
        probs = np.asarray(draft.accept_probs, dtype=np.float64)
        filled = self._filled or 0.0
        unfilled = (1.0 - probs[covered - 1]) * filled  # where the path is not committed, nothing is left
        n, rate = self._ahead_rate(draft, probs, cost, remaining, covered, unfilled, saturated=True)
        bare = min(remaining, 1.0 + filled) / cost.ms(0)
        return covered + n if self.fixed is not None or rate > bare else covered

    def depth(self, cost: CostModel) -> int:
        """Trees to keep in flight once they go ahead: enough passes to fill a round trip and a pass, so that the
        verifier is not left idle through the round trip (a GPU's pass is a few milliseconds, a round trip to it
        tens), at least two (the one awaited and one ahead), at most `max_in_flight`. The verifier drafts for the
        trees beyond the second once the verdicts before them are known (`fill`): what the edge drafts now is left
        of them only below the likeliest path through the trees before (`deeper`); so a tree waiting in the
        verifier's queue loses nothing."""
        if not self.fill:
            return 2
        pass_ms = max(cost.ms(0), 1e-3)
        return int(min(self.max_in_flight, max(2, math.ceil((self.overhead_ms + pass_ms) / pass_ms))))

    def _bare_nodes(self, unknown: int) -> int:
        """Nodes a bare tree's pass verifies: what the verifier lately drafted for one (`unknown` before any). The
        verifier sizes its draft by its own rule, not as the tree waiting would send, which priced the pass before
        (BENCHMARKS.md section 6, "The live run again with the kernels")."""
        return unknown if self._filled_nodes is None else round(self._filled_nodes)

    def bare_tokens(self) -> float:
        """Tokens a bare tree ahead is expected to commit: its pass's own and what the verifier's draft lately
        committed for such trees (none known: the pass's own)."""
        return 1.0 + (self._filled or 0.0)

    def _waiting(self, fresh: DraftTree, cost: CostModel, remaining: int) -> tuple[float, float, int]:
        """(expected tokens per ms, tokens promised, nodes sent) of waiting for the verdict, then sending what
        `choose` takes of `fresh`; the promise, as the rate counts it, scaled by what waits lately committed
        against it."""
        wait = self._size(fresh, cost, remaining)
        promised = sum((fresh.accept_probs or ())[:wait])
        return min(remaining, 1.0 + self._waits_scale() * promised) / (self.overhead_ms + cost.ms(wait)), promised, wait

    def _waits_scale(self) -> float:
        """What the trees sent after waits lately committed against what those waits were priced at."""
        return _ratio(self._waits_committed, self._waits_priced)

    def _ahead_rate(self, draft: DraftTree, probs: np.ndarray, cost: CostModel, remaining: int, covered: int,
                    unfilled: float = 0.0, saturated: bool = False) -> tuple[int, float]:
        """(n, expected tokens per ms) of the best n nodes below the first `covered` to send ahead (the fixed
        size where there is one); `unfilled`: tokens the verifier's own draft adds whatever n is. `saturated`: the
        trees in flight fill the round trip, and a verdict comes every pass."""
        cap = self.max_nodes if self.server_cap is None else min(self.max_nodes, self.server_cap)
        below = np.arange(covered, min(len(draft), covered + cap))
        adds = np.where(np.asarray(draft.parents, dtype=np.int64)[below] >= covered, probs[below], 0.0)
        expected = np.minimum(1.0 + unfilled + np.concatenate(([0.0], np.cumsum(adds))), remaining)
        pass_ms = cost.table(len(below))
        rate = expected / (pass_ms if saturated else self._pipelined_ms(pass_ms))
        n = min(self.fixed, len(below)) if self.fixed is not None else int(np.argmax(rate))
        return n, float(rate[n])

    def _pipelined_ms(self, pass_ms):
        """Time between verdicts with two trees in flight: a pass, or half a round trip and a pass."""
        return pass_ms + np.maximum(0.0, (self.overhead_ms - pass_ms) / 2)

    @property
    def fill_tokens(self) -> int:
        """The most nodes a tree ahead may have once the verifier has added its own draft (0: none added)."""
        return (self.fixed or self.max_nodes) if self.fill else 0

    def observe(self, tree: DraftTree, result: StepResult, ahead: bool = False, draft_ms: float = 0.0) -> None:
        """Track what a round costs besides the pass itself (a longer round trip favours bigger trees): the
        network, the queue and, for a tree drafted after the verdict before it, its drafting (`draft_ms`), which
        the verifier waits through as it does through the network. A tree sent ahead waited on the verifier for
        the verdict before it: its wait tells nothing of the network; where nothing of it was left, it tells what
        the verifier's draft committed. A tree sent after a wait tells what the wait was worth against its price."""
        if not ahead:
            measured = result.rtt_ms + result.queue_ms + draft_ms
            self.overhead_ms += self.alpha * (measured - self.overhead_ms)
            if self._awaited is not None:
                self._waits_committed = _mean(self._waits_committed, len(result.accepted), FILL_ALPHA)
                self._waits_priced = _mean(self._waits_priced, self._awaited, FILL_ALPHA)
                self._awaited = None
        elif self.fill and not len(tree):  # nothing of it was left: the verifier drafted
            self._filled = _mean(self._filled, result.verifier_drafted, FILL_ALPHA)
            if result.verified_nodes is not None:
                self._filled_nodes = _mean(self._filled_nodes, result.verified_nodes, FILL_ALPHA)
        if result.next_max_tree_tokens is not None:
            self.server_cap = result.next_max_tree_tokens
