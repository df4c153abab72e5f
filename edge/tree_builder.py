"""Merge candidate continuations into one draft tree, best nodes first.

Candidates sharing a prefix share trie nodes; a node's weight is the sum of its candidates' weights. Each
node's probability of acceptance given its parent's is estimated by the AcceptanceModel from its share of
the parent's weight and its match length; a node's path probability is the product down from the
root, which never grows along a path. Taking nodes by path probability (best first, shallower first on
ties) therefore yields parents before children, and the expected accepted length of the first n nodes is
the sum of their path probabilities, the largest any n-node tree of these candidates can have.

The trie and the probabilities are computed with a fixed number of numpy operations, whatever the number
of candidates and their depth (a Python dict trie took ~0.7 ms per draft at 64 candidates of 16 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.edge.acceptance_model import AcceptanceModel, NodeStats


@dataclass
class CandidateSet:
    """Many candidates as arrays: continuations padded with -1 on the right."""

    tokens: np.ndarray  # [K, D] int64
    weight: np.ndarray  # [K]
    match_len: np.ndarray  # [K]
    long_term: np.ndarray  # [K] bool

    @classmethod
    def concat(cls, parts: list[CandidateSet]) -> CandidateSet:
        if len(parts) == 1:
            return parts[0]
        depth = max((p.tokens.shape[1] for p in parts), default=0)
        tokens = np.full((sum(len(p.weight) for p in parts), depth), -1, dtype=np.int64)
        row = 0
        for p in parts:
            tokens[row : row + len(p.weight), : p.tokens.shape[1]] = p.tokens
            row += len(p.weight)
        return cls(tokens, np.concatenate([p.weight for p in parts]) if parts else np.zeros(0),
                   np.concatenate([p.match_len for p in parts]) if parts else np.zeros(0, dtype=np.int64),
                   np.concatenate([p.long_term for p in parts]) if parts else np.zeros(0, dtype=bool))


def build_draft(candidates: CandidateSet, model: AcceptanceModel, max_nodes: int, max_depth: int
                ) -> tuple[DraftTree, NodeStats]:
    """The best-first tree of at most `max_nodes` nodes, with its acceptance estimates, and each node's
    evidence."""
    trie = _Trie(candidates, max_depth)
    if trie.size == 0 or max_nodes <= 0:
        empty = np.zeros(0, dtype=np.int64)
        return DraftTree([], [], accept_probs=[]), NodeStats(empty.astype(bool), empty, empty.astype(float))
    stats = trie.stats()
    cond = model.probs(stats)
    # Path probability: the product of conditionals along each candidate's row, read off at its nodes.
    rows = np.where(trie.valid, cond[np.maximum(trie.node_at, 0)], 1.0).cumprod(axis=1)
    path = np.empty(trie.size)
    path[trie.node_at[trie.valid]] = rows[trie.valid]
    order = np.lexsort((trie.depth, -path))[:max_nodes]
    new_index = np.full(trie.size, -1, dtype=np.int64)
    new_index[order] = np.arange(len(order))
    parents = np.where(trie.parent[order] < 0, -1, new_index[np.maximum(trie.parent[order], 0)])
    probs = np.clip(path[order], 0.0, 1.0).tolist()
    return DraftTree(trie.token[order].tolist(), parents.tolist(), accept_probs=probs), stats.take(order)


class _Trie:
    """The candidates' trie as parallel node arrays, built without a per-node Python loop.

    Candidates are sorted lexicographically; a row creates a node at depth d when it differs from the row
    before it within its first d + 1 tokens. `node_at[i, d]` is the node of row i's prefix of length d + 1
    (the last node created at depth d by row i or a row above it, which shares that prefix).
    """

    def __init__(self, candidates: CandidateSet, max_depth: int) -> None:
        tokens = candidates.tokens[:, :max_depth]
        k, depth = tokens.shape
        order = np.lexsort(tokens.T[::-1]) if depth else np.arange(k)
        tokens = tokens[order]
        weight = candidates.weight[order]
        match = candidates.match_len[order]
        short = ~candidates.long_term[order]
        self.root_weight = weight.sum()
        self.valid = tokens >= 0
        same = np.zeros((k, depth), dtype=bool)
        same[1:] = np.logical_and.accumulate(tokens[1:] == tokens[:-1], axis=1)  # shares the prefix up to d
        created = self.valid & ~same
        ids = np.cumsum(created.ravel()).reshape(k, depth) - 1  # node ids in row-major creation order
        self.size = int(created.sum())
        creator = np.maximum.accumulate(np.where(created, np.arange(k)[:, None], 0), axis=0)
        self.node_at = np.where(self.valid, ids[creator, np.arange(depth)[None, :]], -1)
        rows, cols = np.nonzero(created)
        node = ids[rows, cols]
        self.token = np.empty(self.size, dtype=np.int64)
        self.token[node] = tokens[rows, cols]
        self.depth = np.empty(self.size, dtype=np.int64)
        self.depth[node] = cols + 1
        self.parent = np.empty(self.size, dtype=np.int64)
        self.parent[node] = np.where(cols > 0, self.node_at[rows, np.maximum(cols - 1, 0)], -1)
        at = self.node_at[self.valid]
        row_of = np.nonzero(self.valid)[0]
        self.weight = np.bincount(at, weights=weight[row_of], minlength=self.size)
        self.match = np.zeros(self.size, dtype=np.int64)
        np.maximum.at(self.match, at, match[row_of])
        self.short = np.bincount(at, weights=short[row_of], minlength=self.size) > 0

    def stats(self) -> NodeStats:
        parent_weight = np.where(self.parent < 0, self.root_weight, self.weight[np.maximum(self.parent, 0)])
        return NodeStats(~self.short, self.match, self.weight / parent_weight)
