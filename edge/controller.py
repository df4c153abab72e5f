"""How many draft nodes to send: the prefix of the best-first draft that maximises expected committed
tokens per second, given the verifier's cost model and the time a round costs besides the pass."""

from __future__ import annotations

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES, best_tree_size


class TreeSizeController:
    def __init__(self, max_nodes: int = MAX_TREE_NODES, overhead_ms: float = 0.0, alpha: float = 0.3) -> None:
        self.max_nodes = max_nodes
        self.overhead_ms = overhead_ms  # per round besides the pass: network round trip, queueing
        self.alpha = alpha
        self.server_cap: int | None = None  # the largest tree the verifier said it will take next

    def choose(self, draft: DraftTree, cost: CostModel, remaining: int) -> int:
        """Number of leading draft nodes to send (0 = just let the verifier decode one token)."""
        cap = self.max_nodes if self.server_cap is None else min(self.max_nodes, self.server_cap)
        if draft.accept_probs is None:  # the drafter cannot estimate: trust its own size
            return min(len(draft), cap)
        probs = draft.accept_probs[:cap]
        return best_tree_size(probs, cost.table(len(probs)), overhead_ms=self.overhead_ms, most_tokens=remaining)

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """Track what a round costs besides the pass itself (a longer round trip favours bigger trees)."""
        measured = result.rtt_ms + result.queue_ms
        self.overhead_ms += self.alpha * (measured - self.overhead_ms)
        if result.next_max_tree_tokens is not None:
            self.server_cap = result.next_max_tree_tokens
