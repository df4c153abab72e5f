"""The one small interface every draft source implements, and adapters for simple ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult


@dataclass
class Draft:
    """A tree in best-first order (any prefix of its nodes is a tree too) and, when the drafter can tell,
    each node's estimated probability of being accepted (non-increasing along the order)."""

    tree: DraftTree
    accept_probs: list[float] | None = None

    def first(self, n: int) -> DraftTree:
        """The first n nodes, carrying their acceptance estimates for the verifier."""
        tree = self.tree.prefix(n)
        if self.accept_probs is not None and tree.scores is None:
            tree = DraftTree(tree.tokens, tree.parents, tree.proposals, [min(1.0, max(0.0, p)) for p in self.accept_probs[:n]])
        return tree


class Drafter(Protocol):
    def begin(self, prompt_ids: list[int]) -> None:
        """A new generation starts from these prompt tokens."""

    def propose(self) -> Draft:
        """A draft hanging off the last committed token."""

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """The verifier's answer to `tree`: `result.tokens` are now committed."""

    def end(self) -> None:
        """The generation is over."""


class FunctionDrafter:
    """Adapts a function of the committed token ids (prompt + output) to the Drafter interface."""

    def __init__(self, fn: Callable[[list[int]], DraftTree]) -> None:
        self.fn = fn
        self.committed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.committed = list(prompt_ids)

    def propose(self) -> Draft:
        return Draft(self.fn(self.committed))

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        self.committed.extend(result.tokens)

    def end(self) -> None:
        pass
