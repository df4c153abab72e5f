"""A draft token tree hanging off the last committed token (the root, which is not part of the tree)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int]
    # Parent index of each node; -1 is the root. Parents come before their children.
    parents: list[int]
    # For drafts sampled from a model: parent index (-1 = root) -> the sparse proposal q (token ids,
    # probabilities) from which that parent's children were drawn without replacement, in index order.
    proposals: dict[int, tuple[list[int], list[float]]] | None = None
    # Optional: the drafter's estimate that each node is accepted (its path probability, so never more
    # than its parent's). Drafters send nodes best first, so any prefix of the nodes is the best tree of
    # its size; a loaded verifier trims by these estimates.
    accept_probs: list[float] | None = None
    # Optional, never sent: what the drafter wants to learn from each node's verdict (e.g. the acceptance
    # model's cell it was estimated from). It travels with the nodes through `prefix` and `after`, so a
    # verdict on a tree sent ahead of others is learned from with its own nodes' notes.
    notes: list | None = None
    # Never sent: the whole draft this tree is the first nodes of (set by `prefix`, kept by `after`). In a
    # greedy generation the committed text judges every node of it, sent or not (edge/calibration.py).
    drafted: DraftTree | None = field(default=None, compare=False, repr=False)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(tokens=[], parents=[])

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A single path: each node is the child of the previous one."""
        return cls(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: a tree too, since parents come before their children."""
        if n >= len(self):
            return self
        proposals = None if self.proposals is None else {p: q for p, q in self.proposals.items() if p < n}
        accept_probs = None if self.accept_probs is None else self.accept_probs[:n]
        notes = None if self.notes is None else self.notes[:n]
        return DraftTree(self.tokens[:n], self.parents[:n], proposals, accept_probs, notes,
                         self.drafted if self.drafted is not None else self)

    def after(self, path: list[int]) -> DraftTree:
        """What is left of this tree once `path` (tokens) has been committed after its root: the subtree
        below the nodes that spell it, re-indexed in the same order, its proposals and acceptance estimates
        (now given the path) kept. Empty when the tree does not spell the whole path. A tree sent ahead of a
        verdict is verified this way, and its sender works out the same subtree to read the answer."""
        if not path:
            return self
        drafted = None if self.drafted is None else self.drafted.after(path)
        children = self.children()
        node = -1
        for token in path:
            node = next((c for c in children[node + 1] if self.tokens[c] == token), None)
            if node is None:
                return DraftTree([], [], drafted=drafted)
        index = {node: -1}  # old index -> new index; the last node of the path becomes the root
        for i in range(node + 1, len(self)):
            if self.parents[i] in index:
                index[i] = len(index) - 1
        kept = [i for i in index if i != node]
        proposals = None if self.proposals is None else {
            index[p]: q for p, q in self.proposals.items() if p in index}
        accept_probs = None
        if self.accept_probs is not None:
            given = self.accept_probs[node]
            accept_probs = [min(1.0, self.accept_probs[i] / given) if given > 0 else self.accept_probs[i]
                            for i in kept]
        notes = None if self.notes is None else [self.notes[i] for i in kept]
        return DraftTree([self.tokens[i] for i in kept], [index[self.parents[i]] for i in kept], proposals,
                         accept_probs, notes, drafted)

    def validate(self, vocab_size: int) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"tokens and parents differ in length: {n} != {len(self.parents)}")
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not 0 <= token < vocab_size:
                raise ValueError(f"node {i}: token {token} is outside the vocabulary [0, {vocab_size})")
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be in [-1, {i}) (-1 = root)")
        if self.accept_probs is not None:
            if len(self.accept_probs) != n:
                raise ValueError(f"{len(self.accept_probs)} acceptance estimates for {n} nodes")
            if any(not (0.0 <= x <= 1.0) for x in self.accept_probs):
                raise ValueError("acceptance estimates must be probabilities in [0, 1]")
        children = self.children()
        for parent, kids in enumerate(children, start=-1):
            kid_tokens = [self.tokens[c] for c in kids]
            if len(set(kid_tokens)) != len(kid_tokens):
                raise ValueError(f"node {parent}: two children carry the same token ({kid_tokens})")
        for parent, (ids, probs) in (self.proposals or {}).items():
            where = f"proposal for node {parent}"
            if not -1 <= parent < n:
                raise ValueError(f"{where}: no such node (tree has {n} nodes, -1 = root)")
            if len(ids) != len(probs):
                raise ValueError(f"{where}: {len(ids)} token ids but {len(probs)} probabilities")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{where}: repeated token ids")
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"{where}: token ids outside the vocabulary [0, {vocab_size})")
            if any(not (math.isfinite(q) and q >= 0) for q in probs):
                raise ValueError(f"{where}: probabilities must be finite and non-negative")
            if abs(sum(probs) - 1) > 1e-4:
                raise ValueError(f"{where}: probabilities sum to {sum(probs)}, not 1")
            q = dict(zip(ids, probs))
            for c in children[parent + 1]:
                if q.get(self.tokens[c], 0) <= 0:
                    raise ValueError(f"{where}: child node {c} (token {self.tokens[c]}) has q = 0, so it "
                                     "cannot have been drawn from it")

    def children(self) -> list[list[int]]:
        """Children of the root at index 0 and of node i at index i + 1, in index order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return kids

    def depths(self) -> list[int]:
        """Depth of each node; the root's children have depth 1."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def likeliest_path(self) -> list[int]:
        """Node indices from the root down to a leaf, each the likeliest child of the one before (by the
        acceptance estimates; without them, the first child)."""
        children, path = self.children(), []
        probs = self.accept_probs or [1.0] * len(self)
        while kids := children[path[-1] + 1 if path else 0]:
            path.append(max(kids, key=lambda k: probs[k]))
        return path

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]
