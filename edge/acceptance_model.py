"""How likely the verifier is to accept a draft node, learned online from the verifier's answers.

A node is *reached* when its parent was accepted (the root's children always are). Among reached nodes,
the acceptance rate is tracked per cell of (source, match-length bucket, depth bucket, share bucket), with
a prior of `share * BASE[match bucket]` worth PRIOR_WEIGHT observations, so a fresh model is cautious and
every answer sharpens it. This is what lets the controller skip drafting where matches are weak.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MATCH_BUCKETS = [1, 2, 3, 4, 6, 9, 17]  # lower bounds of the match-length buckets
BASE = [0.15, 0.25, 0.4, 0.5, 0.6, 0.7, 0.8]  # prior acceptance of a sole continuation, per match bucket
DEPTH_BUCKETS = [1, 2, 3, 5, 9]
SHARE_BUCKETS = [0.0, 0.25, 0.5, 0.75, 0.95]
PRIOR_WEIGHT = 4.0


@dataclass(frozen=True)
class NodeFeatures:
    long_term: bool  # supported only by the long-term datastore
    match_len: int
    depth: int
    share: float  # the node's weight over its parent's: its part of the evidence at the parent
    support: int = 1  # candidates (occurrences) through the node

    def cell(self) -> tuple[bool, int, int, int]:
        return (
            self.long_term,
            bisect.bisect_right(MATCH_BUCKETS, self.match_len) - 1,
            bisect.bisect_right(DEPTH_BUCKETS, self.depth) - 1,
            bisect.bisect_right(SHARE_BUCKETS, self.share) - 1,
        )


class AcceptanceModel:
    def __init__(self) -> None:
        self.counts: dict[tuple, list[float]] = {}  # cell -> [accepted, reached]

    def prob(self, f: NodeFeatures) -> float:
        cell = f.cell()
        prior = f.share * BASE[max(cell[1], 0)]
        accepted, reached = self.counts.get(cell, (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)

    def update(self, f: NodeFeatures, accepted: bool) -> None:
        c = self.counts.setdefault(f.cell(), [0.0, 0.0])
        c[0] += accepted
        c[1] += 1
