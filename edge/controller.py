"""How many draft nodes to send: the prefix of the best-first draft that maximises expected committed
tokens per second, given the verifier's cost model and the time a round costs besides the pass."""

from __future__ import annotations

import numpy as np

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult
from specedge.edge.drafter import Draft


class TreeSizeController:
    def __init__(self, max_nodes: int = 64, overhead_ms: float = 0.0, alpha: float = 0.3) -> None:
        self.max_nodes = max_nodes
        self.overhead_ms = overhead_ms  # per round besides the pass: network round trip, queueing
        self.alpha = alpha
        self.server_cap: int | None = None  # the largest tree the verifier said it will take next

    def choose(self, draft: Draft, cost: CostModel, remaining: int) -> int:
        """Number of leading draft nodes to send (0 = just let the verifier decode one token)."""
        if draft.accept_probs is None:  # the drafter cannot estimate: trust its own size
            return min(len(draft.tree), self.max_nodes, self.server_cap if self.server_cap is not None else 1 << 30)
        cap = self.max_nodes if self.server_cap is None else min(self.max_nodes, self.server_cap)
        probs = np.asarray(draft.accept_probs[:cap], dtype=np.float64)
        expected = np.minimum(1.0 + np.concatenate(([0.0], np.cumsum(probs))), remaining)  # the bonus always comes
        rate = expected / (cost.table(len(probs)) + self.overhead_ms)
        return int(np.argmax(rate))  # the smallest of the best sizes

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """Track what a round costs besides the pass itself (a longer round trip favours bigger trees)."""
        measured = result.rtt_ms + result.queue_ms
        self.overhead_ms += self.alpha * (measured - self.overhead_ms)
        self.server_cap = result.extra.get("next_max_tree_tokens", self.server_cap)
