"""Verifier hints: the target's own most likely next tokens at every position a pass computed.

A verification pass computes the target's distribution at the root (the last committed token) and at
every draft node, accepted or not; the verdict needs only a few of them. A client that asks for hints gets
each row's top k tokens with their probabilities (at the session's temperature; 1 for greedy), which the
edge recycles into drafts (edge/recycling.py). Row 0 is the root, row 1 + i draft node i.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HINTS_TOP_K = 8  # what a drafter that uses hints asks for, and a verifier's default cap


@dataclass
class Hints:
    ids: list[list[int]]  # per row, the k most likely token ids, most likely first; [] = not known
    probs: list[list[float]]  # their probabilities, same shape

    def __len__(self) -> int:
        return len(self.ids)
