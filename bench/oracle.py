"""A drafter that knows the answer: it drafts the true continuation. The ceiling for any drafter,
used by tests and benchmarks only (a real edge never has the reference)."""

from __future__ import annotations

from specedge.common.draft_tree import DraftTree
from specedge.edge.drafter import FunctionDrafter


class OracleDrafter(FunctionDrafter):
    def __init__(self, reference: list[int], depth: int) -> None:
        self.reference = list(reference)  # prompt + the target's own output
        self.depth = depth
        super().__init__(self._draft)

    def _draft(self, committed: list[int]) -> DraftTree:
        n = len(committed)
        if committed != self.reference[:n]:  # off the reference: nothing true to offer
            return DraftTree.empty()
        return DraftTree.chain(self.reference[n : n + self.depth])
