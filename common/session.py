"""What an edge client needs from a verifier, wherever it runs: in this process or across the network."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams


@dataclass
class StepResult:
    tokens: list[int]  # newly committed: the accepted draft tokens, then the verifier's bonus token
    accepted: list[int]  # indices of the accepted tree nodes, root to leaf
    compute_ms: float  # the verifier's forward pass and acceptance
    queue_ms: float = 0.0  # waiting for a batch slot on the verifier
    rtt_ms: float = 0.0  # the rest of the round trip: network, serialisation
    next_max_tree_tokens: int | None = None  # the largest tree the verifier will take untrimmed next round
    hints: Hints | None = None  # the target's top tokens at the root and every node sent, when asked for
    # The first result's, when asked for: the target's top tokens after each prompt position the verifier
    # computed (cloud/prompt_hints.py), row j after position prompt_hints_start + j
    prompt_hints: Hints | None = None
    prompt_hints_start: int = 0
    verifier_drafted: int = 0  # of `tokens`, those the verifier drafted itself (a tree ahead's fill_tokens)
    verified_nodes: int | None = None  # the draft nodes `compute_ms` verified (None: the tree as sent; cut by
    # the verifier's plan, or filled with its own draft)


class VerifierSession(Protocol):
    """One generation on a verifier. The first step also prefills the prompt."""

    vocab_size: int
    max_tree_tokens: int  # the largest draft tree the verifier takes in one round
    prompt_ids: list[int]
    params: SamplingParams

    def step(self, tree: DraftTree) -> StepResult: ...

    def cost_model(self) -> CostModel: ...

    def close(self) -> None: ...
