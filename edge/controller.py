"""How many draft nodes to send: the prefix of the best-first draft that maximises expected committed
tokens per second, given the verifier's cost model and the time a round costs besides the pass; and
whether to send a second tree ahead of the verdict in flight over a long round trip."""

from __future__ import annotations

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES, best_tree_size


class TreeSizeController:
    def __init__(self, max_nodes: int = MAX_TREE_NODES, overhead_ms: float = 0.0, alpha: float = 0.3,
                 fixed: int | None = None, overlap: bool = True) -> None:
        """`fixed`: always send this many nodes (as many as the draft has, within the caps) instead of the
        expected-value choice: the fixed sizes that experiments compare the choice with. `overlap`: send a
        tree ahead of the verdict in flight where that pays (see `ahead`)."""
        self.max_nodes = max_nodes
        self.fixed = fixed
        self.overlap = overlap
        self.overhead_ms = overhead_ms  # per round besides the pass: network round trip, queueing
        self.alpha = alpha
        self.server_cap: int | None = None  # the largest tree the verifier said it will take next

    def choose(self, draft: DraftTree, cost: CostModel, remaining: int) -> int:
        """Number of leading draft nodes to send (0 = just let the verifier decode one token)."""
        cap = self.max_nodes if self.server_cap is None else min(self.max_nodes, self.server_cap)
        if self.fixed is not None:
            return min(self.fixed, len(draft), cap)
        if draft.accept_probs is None:  # the drafter cannot estimate: trust its own size
            return min(len(draft), cap)
        probs = draft.accept_probs[:cap]
        return best_tree_size(probs, cost.table(len(probs)), overhead_ms=self.overhead_ms, most_tokens=remaining)

    def ahead(self, draft: DraftTree, cost: CostModel, remaining: int, covered: int) -> int:
        """Nodes of `draft` to send ahead of the verdict in flight (0: wait for it instead). The verifier
        verifies what is left of them once that verdict is committed, and answers a pass after it instead
        of a round trip after: worth it when the round trip is longer than that pass. The first `covered`
        nodes stand for what the verdict in flight may commit; as many again as a round of its own would
        send go below them."""
        if not self.overlap:
            return 0
        own = max(1, self.choose(draft, cost, remaining))
        if self.overhead_ms <= cost.ms(own):
            return 0
        return min(len(draft), covered + own)  # the caps bound what is verified, `own` (see `choose`)

    def observe(self, tree: DraftTree, result: StepResult, ahead: bool = False) -> None:
        """Track what a round costs besides the pass itself (a longer round trip favours bigger trees). A
        tree sent ahead waited on the verifier for the verdict before it: its wait tells nothing of the
        network, so only the verifier's cap is read from it."""
        if not ahead:
            measured = result.rtt_ms + result.queue_ms
            self.overhead_ms += self.alpha * (measured - self.overhead_ms)
        if result.next_max_tree_tokens is not None:
            self.server_cap = result.next_max_tree_tokens
