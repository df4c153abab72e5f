"""SuffixDecoding's drafter (Snowflake's `arctic-inference` package) behind our Drafter interface: the peer
baseline `suffix` of `specedge bench`. Its suffix trees cover the prompt and, across generations, every
earlier response; drafts are its trees, verified by our engine like any other."""

from __future__ import annotations

import itertools

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult


class SuffixDecodingDrafter:
    def __init__(self, max_spec_tokens: int = 16, use_tree_spec: bool = True, max_depth: int = 64) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise RuntimeError("the `suffix` baseline needs the arctic-inference package (`make venv` installs "
                               "it; see the Makefile)") from e
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth)
        self.max_spec_tokens, self.use_tree_spec, self.max_depth = max_spec_tokens, use_tree_spec, max_depth
        self._ids = itertools.count()
        self.req = None
        self.context: list[int] = []

    def begin(self, prompt_ids: list[int], params=None) -> None:
        self.req = next(self._ids)
        self.context = list(prompt_ids)
        self.cache.start_request(self.req, np.asarray(prompt_ids, dtype=np.int32))

    def propose(self) -> DraftTree:
        d = self.cache.speculate(self.req, np.asarray(self.context[-self.max_depth :], dtype=np.int32),
                                 max_spec_tokens=self.max_spec_tokens, use_tree_spec=self.use_tree_spec)
        return _as_tree(list(d.token_ids), list(d.parents))

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        self.context.extend(result.tokens)
        self.cache.add_active_response(self.req, np.asarray(result.tokens, dtype=np.int32))

    def end(self) -> None:
        self.cache.stop_request(self.req)  # its response stays in the global cache for later requests


def _as_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    """Reorder so that parents precede children (breadth first), as DraftTree requires."""
    order, kids = [], {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    frontier = list(kids.get(-1, []))
    while frontier:
        order += frontier
        frontier = [c for i in frontier for c in kids.get(i, [])]
    new = {old: new for new, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order], [new.get(parents[i], -1) for i in order])
