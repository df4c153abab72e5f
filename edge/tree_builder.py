"""Merge candidate continuations into one draft tree, best nodes first.

Candidates sharing a prefix share trie nodes; a node's weight is the sum of its candidates' weights. Each
node's probability of acceptance given its parent's is estimated by the AcceptanceModel from its share of
the parent's weight, its match length and depth; a node's path probability is the product down from the
root, which never grows along a path. Popping nodes by path probability (best first) therefore yields
parents before children, and the expected accepted length of the first n nodes is the sum of their path
probabilities, the largest any n-node tree of these candidates can have.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from specedge.common.draft_tree import DraftTree
from specedge.edge.acceptance_model import AcceptanceModel, NodeFeatures
from specedge.edge.drafter import Draft


@dataclass
class Candidate:
    tokens: list[int]  # the continuation after the root
    weight: float  # evidence: occurrence weighted by match length and recency
    match_len: int  # context tokens matched right before the continuation
    long_term: bool = False  # from the long-term datastore (else from the context itself)


@dataclass
class _TrieNode:
    weight: float = 0.0
    support: int = 0
    match_len: int = 0
    short_term: bool = False
    children: dict[int, _TrieNode] = field(default_factory=dict)


def build_draft(
    candidates: list[Candidate], model: AcceptanceModel, max_nodes: int, max_depth: int
) -> tuple[Draft, list[NodeFeatures]]:
    """The best-first tree of at most `max_nodes` nodes, with each node's acceptance features."""
    root = _TrieNode()
    for c in candidates:
        node = root
        root.weight += c.weight
        for token in c.tokens[:max_depth]:
            node = node.children.setdefault(token, _TrieNode())
            node.weight += c.weight
            node.support += 1
            node.match_len = max(node.match_len, c.match_len)
            node.short_term |= not c.long_term

    tokens, parents, probs, features = [], [], [], []
    heap: list[tuple[float, int, int, int, _TrieNode, NodeFeatures]] = []
    tie = 0

    def push_children(parent_index: int, parent: _TrieNode, parent_prob: float, depth: int) -> None:
        nonlocal tie
        if depth > max_depth:
            return
        for token, child in parent.children.items():
            f = NodeFeatures(not child.short_term, child.match_len, depth, child.weight / parent.weight, child.support)
            p = parent_prob * model.prob(f)
            heapq.heappush(heap, (-p, tie, parent_index, token, child, f))
            tie += 1

    push_children(-1, root, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg_p, _, parent_index, token, node, f = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent_index)
        probs.append(-neg_p)
        features.append(f)
        push_children(len(tokens) - 1, node, -neg_p, f.depth + 1)
    return Draft(DraftTree(tokens, parents), probs), features
