"""How likely the verifier is to accept a draft node, learned online from the verifier's answers.

A node is *reached* when its parent was accepted (the root's children always are). Among reached nodes,
the acceptance rate is tracked per cell of (source, match-length bucket, share bucket), with a prior of
`share * BASE[match bucket]` worth PRIOR_WEIGHT observations, so a fresh model is cautious and every answer
sharpens it. This is what lets the controller skip drafting where matches are weak.

Depth is not a dimension: replaying recorded Spec-Bench generations (bench/replay.py) showed depth cells
learning too slowly to pay for themselves (the path product already discounts deep nodes), and a prior
30% more optimistic than the first guess was closer to the measured rates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MATCH_BUCKETS = np.array([1, 2, 3, 4, 6, 9, 17])  # lower bounds of the match-length buckets
BASE = np.array([0.2, 0.33, 0.52, 0.65, 0.78, 0.9, 0.95])  # prior acceptance of a sole continuation, per bucket
SHARE_BUCKETS = np.array([0.0, 0.25, 0.5, 0.75, 0.95])
PRIOR_WEIGHT = 4.0
SHAPE = (2, len(MATCH_BUCKETS), len(SHARE_BUCKETS))


@dataclass
class NodeStats:
    """Per-node evidence, one array entry per node."""

    long_term: np.ndarray  # bool: supported only by the long-term datastore
    match_len: np.ndarray  # longest context match among the node's candidates
    share: np.ndarray  # the node's weight over its parent's: its part of the evidence at the parent

    def cells(self) -> np.ndarray:
        """Flat index of each node's cell in the model's tables."""
        b = lambda edges, x: np.searchsorted(edges, x, side="right") - 1  # noqa: E731
        return np.ravel_multi_index((self.long_term.astype(np.int64), np.maximum(b(MATCH_BUCKETS, self.match_len), 0),
                                     b(SHARE_BUCKETS, self.share)), SHAPE)

    def take(self, index: np.ndarray) -> NodeStats:
        return NodeStats(self.long_term[index], self.match_len[index], self.share[index])


class AcceptanceModel:
    def __init__(self) -> None:
        self.accepted = np.zeros(int(np.prod(SHAPE)))
        self.reached = np.zeros(int(np.prod(SHAPE)))

    def probs(self, stats: NodeStats) -> np.ndarray:
        """P(node accepted | its parent accepted), per node."""
        cells = stats.cells()
        match_bucket = np.unravel_index(cells, SHAPE)[1]
        prior = stats.share * BASE[match_bucket]
        return (self.accepted[cells] + PRIOR_WEIGHT * prior) / (self.reached[cells] + PRIOR_WEIGHT)

    def update(self, cells: np.ndarray, accepted: np.ndarray) -> None:
        """Reached nodes' cells and whether each was accepted."""
        np.add.at(self.reached, cells, 1.0)
        np.add.at(self.accepted, cells, accepted.astype(np.float64))
