"""How many draft nodes to send: the prefix of the best-first draft that maximises expected committed
tokens per second, given the verifier's cost model and the time a round costs besides the pass."""

from __future__ import annotations

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.edge.drafter import Draft


class TreeSizeController:
    def __init__(self, max_nodes: int = 64, overhead_ms: float = 0.0) -> None:
        self.max_nodes = max_nodes
        self.overhead_ms = overhead_ms  # per round besides the pass: network round trip, drafting

    def choose(self, draft: Draft, cost: CostModel, remaining: int) -> int:
        """Number of leading draft nodes to send (0 = just let the verifier decode one token)."""
        if draft.accept_probs is None:  # the drafter cannot estimate: trust its own size
            return min(len(draft.tree), self.max_nodes)
        best_n, best_rate = 0, 1.0 / (cost.ms(0) + self.overhead_ms)
        expected = 1.0  # the verifier's own token always comes
        for n, p in enumerate(draft.accept_probs[: self.max_nodes], start=1):
            expected += p
            rate = min(expected, remaining) / (cost.ms(n) + self.overhead_ms)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        pass
