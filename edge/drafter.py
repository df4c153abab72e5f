"""The one small interface every draft source implements, and adapters for simple ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult


class Drafter(Protocol):
    # Optional: `hints_top_k` (hints_wanted, below); `propose_after(path)`: a draft hanging below `path`
    # (target ids) as if it were committed, to send ahead of a verdict that most likely commits it
    # (edge/generation.py). The generation may not send it (the controller holds it back); `propose` is
    # called only with nothing in flight.

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """A new generation starts from these prompt tokens, sampled with `params` (None: greedy)."""

    def propose(self) -> DraftTree:
        """A draft hanging off the last committed token, best nodes first (any prefix of its nodes is a tree
        too), with each node's estimated probability of acceptance when the drafter can tell."""

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """The verifier's answer to `tree`: `result.tokens` are now committed. A drafter with a `hints_top_k`
        attribute > 0 gets the verifier's hints in `result.hints` (when the verifier offers them)."""

    def end(self) -> None:
        """The generation is over."""


def hints_wanted(drafter: Drafter | None) -> int:
    """Hint tokens per position a drafter drafts from (its `hints_top_k`; 0 for drafters without it)."""
    return getattr(drafter, "hints_top_k", 0)


class SpeculatingDrafter(Drafter, Protocol):
    def speculate(self, stop: Callable[[], bool]) -> None:
        """Called while the last tree sent is being verified and no other is in flight: use the wait (e.g.
        draft ahead) until `stop()` turns true, which it does when the verdict is in. A drafter that drafts
        beyond a path (`propose_after`) is called while a tree ahead is in flight too, with `then=` that
        tree's likeliest path (target ids): its next draft starts beyond it (edge/generation.py)."""


class LearningDrafter(Drafter, Protocol):
    def learn(self) -> None:
        """Learn from the last verdict observed, if not yet. `observe` only commits what the next draft
        needs, and learns whatever is still unlearned; the generation loop calls this while the next verdict is
        on its way, where the session sends without waiting (edge/generation.py)."""


class FunctionDrafter:
    """Adapts a function of the committed token ids (prompt + output) to the Drafter interface."""

    def __init__(self, fn: Callable[[list[int]], DraftTree]) -> None:
        self.fn = fn
        self.committed: list[int] = []

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.committed = list(prompt_ids)

    def propose(self) -> DraftTree:
        return self.fn(self.committed)

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        self.committed.extend(result.tokens)

    def end(self) -> None:
        pass
