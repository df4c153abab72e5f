"""A draft source's raw confidence -> the verifier's measured acceptance, learned online.

A model drafter's own probability of a token is an optimistic guess of the target's agreement (a smaller
model, another tokenizer, a sampled draft); the controller's expected-value rule needs the real rate. Raw
conditional probabilities are bucketed; each bucket starts at its own midpoint with PRIOR_WEIGHT
observations' worth of belief and moves with every node the verifier reached. The buckets are kept across
generations; within one, the estimates move by the generation's own shift (edge/generation_shift.py).
"""

from __future__ import annotations

import bisect

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.edge.generation_shift import GenerationShift, shifted_value

EDGES = np.linspace(0.0, 1.0, 11)[1:-1]  # ten buckets of raw probability
_EDGES = EDGES.tolist()
PRIOR_WEIGHT = 4.0


class Calibration:
    def __init__(self, prior_scale: float = 1.0) -> None:
        """`prior_scale`: a fresh bucket believes in this share of its midpoint."""
        self.accepted = np.zeros(len(EDGES) + 1)
        self.reached = np.zeros(len(EDGES) + 1)
        self._prior = prior_scale * (np.concatenate(([0.0], EDGES)) + np.concatenate((EDGES, [1.0]))) / 2
        self.generation = GenerationShift(lambda buckets, _: self._long_run(buckets))

    @staticmethod
    def buckets(raw: np.ndarray) -> np.ndarray:
        return np.searchsorted(EDGES, np.asarray(raw, dtype=np.float64), side="right")

    def probs(self, raw: np.ndarray) -> np.ndarray:
        """P(node accepted | its parent accepted) for nodes of these raw conditional probabilities."""
        return np.asarray(self.bucket_probs())[self.buckets(raw)]

    def prob(self, raw: float) -> float:
        """`probs` of one raw probability."""
        return self.bucket_probs()[bisect.bisect_right(_EDGES, raw)]

    def bucket_probs(self) -> list[float]:
        """`probs` for each bucket of raw probability, lowest first (in Python: eleven values, read per draft)."""
        shift = self.generation.value
        return [shifted_value(p, shift) for p in self._long_run_buckets()]

    def _long_run(self, b: np.ndarray) -> np.ndarray:
        return np.asarray(self._long_run_buckets())[b]

    def _long_run_buckets(self) -> list[float]:
        return [(a + PRIOR_WEIGHT * p) / (r + PRIOR_WEIGHT)
                for a, r, p in zip(self.accepted.tolist(), self.reached.tolist(), self._prior.tolist())]

    def update(self, buckets: np.ndarray, accepted: np.ndarray) -> None:
        """Reached nodes' buckets and whether each was accepted."""
        np.add.at(self.reached, buckets, 1.0)
        np.add.at(self.accepted, buckets, np.asarray(accepted, dtype=np.float64))
        self.generation.observe(buckets, np.zeros(len(buckets)), np.asarray(accepted, dtype=bool))


def reached_and_accepted(parents: list[int], accepted_nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For a verified tree: which nodes were reached (their parent accepted, or the root's children) and,
    per node, whether it was accepted."""
    n = len(parents)
    accepted = np.zeros(n + 1, dtype=bool)  # index i + 1 for node i, 0 for the root
    accepted[0] = True
    accepted[np.asarray(accepted_nodes, dtype=np.int64) + 1] = True
    reached = accepted[np.asarray(parents, dtype=np.int64) + 1]
    return reached, accepted[1:]


def judged_by_text(tree: DraftTree, committed: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For every node of a draft, sent or not, in a greedy generation: whether it was reached and accepted
    by the text the verdict committed after its root (the target's own tokens, the bonus one included: a
    greedy verifier accepts exactly the path that spells them). Learning from the nodes left unsent too
    makes what a source learns independent of what was sent beside it (by the controller, or by another
    source in a hybrid tree). A node deeper than the committed text is not reached: the text cannot judge it."""
    reached = np.zeros(len(tree), dtype=bool)
    accepted = np.zeros(len(tree), dtype=bool)
    for i, (depth, token, parent) in enumerate(zip(tree.depths(), tree.tokens, tree.parents)):
        if depth <= len(committed) and (parent < 0 or accepted[parent]):
            reached[i] = True
            accepted[i] = token == committed[depth - 1]
    return reached, accepted
