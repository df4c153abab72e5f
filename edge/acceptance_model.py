"""How likely the verifier is to accept a draft node, learned online from the verifier's answers.

A node is *reached* when its parent was accepted (the root's children always are; in a greedy generation
every node drafted is judged, sent or not: edge/calibration.py, `judged_by_text`). Among reached nodes,
the acceptance rate is tracked per cell of (source, match-length bucket, share bucket), with a prior of
`share * BASE[match bucket]` worth PRIOR_WEIGHT observations, so a fresh model is cautious and every answer
sharpens it. This is what lets the controller skip drafting where matches are weak.

Depth is not a dimension: replaying recorded Spec-Bench generations (bench/replay.py) showed depth cells
learning too slowly to pay for themselves (the path product already discounts deep nodes), and a prior
30% more optimistic than the first guess was closer to the measured rates.

The tables are kept across generations; within one, the estimates move by the generation's own shift
(edge/generation_shift.py), fitted to the nodes reached in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specedge.edge.generation_shift import GenerationShift

MATCH_BUCKETS = np.array([1, 2, 3, 4, 6, 9, 17])  # lower bounds of the match-length buckets
BASE = np.array([0.2, 0.33, 0.52, 0.65, 0.78, 0.9, 0.95])  # prior acceptance of a sole continuation, per bucket
SHARE_BUCKETS = np.array([0.0, 0.25, 0.5, 0.75, 0.95])
PRIOR_WEIGHT = 4.0
SHAPE = (2, len(MATCH_BUCKETS), len(SHARE_BUCKETS))


@dataclass
class NodeStats:
    """Per-node evidence, one array entry per node; and what the model reads of it: each node's `cells` (flat
    index in the model's tables) and `priors` (what a fresh model believes of it)."""

    long_term: np.ndarray  # bool: supported only by the long-term datastore
    match_len: np.ndarray  # longest context match among the node's candidates
    share: np.ndarray  # the node's weight over its parent's: its part of the evidence at the parent

    def __post_init__(self) -> None:
        match = np.maximum(np.searchsorted(MATCH_BUCKETS, self.match_len, side="right") - 1, 0)
        share = np.searchsorted(SHARE_BUCKETS, self.share, side="right") - 1
        self.cells = (self.long_term.astype(np.int64) * SHAPE[1] + match) * SHAPE[2] + share
        self.priors = self.share * BASE[match]

    def take(self, index: np.ndarray) -> NodeStats:
        taken = object.__new__(NodeStats)  # what __post_init__ derived is taken too, not derived again
        for name in ("long_term", "match_len", "share", "cells", "priors"):
            setattr(taken, name, getattr(self, name)[index])
        return taken


class AcceptanceModel:
    def __init__(self) -> None:
        self.accepted = np.zeros(int(np.prod(SHAPE)))
        self.reached = np.zeros(int(np.prod(SHAPE)))
        self.generation = GenerationShift(self._long_run)  # this generation's shift of the tables' estimates

    def probs(self, stats: NodeStats) -> np.ndarray:
        """P(node accepted | its parent accepted), per node."""
        return self.generation.apply(self._long_run(stats.cells, stats.priors))

    def _long_run(self, cells: np.ndarray, priors: np.ndarray) -> np.ndarray:
        return (self.accepted[cells] + PRIOR_WEIGHT * priors) / (self.reached[cells] + PRIOR_WEIGHT)

    def update(self, cells: np.ndarray, priors: np.ndarray, accepted: np.ndarray) -> None:
        """Reached nodes' `NodeStats.cells` and `priors`, and whether each was accepted."""
        np.add.at(self.reached, cells, 1.0)
        np.add.at(self.accepted, cells, accepted.astype(np.float64))
        self.generation.observe(cells, priors, accepted)
