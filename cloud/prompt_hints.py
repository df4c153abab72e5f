"""Hints at the prompt's positions: the target's likeliest next tokens after every prompt token the prefill computed.

A prefill computes the hidden state at every prompt position and throws all but the last away. The output layer
over all of them would cost a fifth of the prefill again (SmolLM2: 28M of its 134M weights per token), so these
rows are the target's top k among a few candidates only: the prompt's own tokens and the vocabulary's first
COMMON ids (byte-level BPE and SentencePiece vocabularies number their most frequent pieces first), about 1% of the
prefill by count of weights. The probabilities are normalised over the candidates, so they overstate what the full
softmax gives; the edge's table calibrates every row by the verdicts it earns anyway (edge/recycling.py). Replaying Spec-Bench
summarization and rag, these rows raised the drafter's tokens per pass as much as full-vocabulary rows did
(BENCHMARKS.md section 7, "Hints at the prompt's positions").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specedge.common.hints import Hints

COMMON = 1024


def candidates(prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The token ids the prompt's rows choose among, ascending."""
    common = torch.arange(min(COMMON, vocab_size))
    own = torch.tensor(prompt_ids, dtype=torch.long)
    return torch.unique(torch.cat([common, own[own < vocab_size]]))


@torch.inference_mode()
def prompt_hints(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, k: int,
                 softcap: float | None = None, temperature: float = 0.0) -> Hints:
    """Each row's k likeliest of `ids` for final hidden states `hidden` [N, D] (normed) under the output layer
    `weight` [V, D], with their probabilities among `ids` at `temperature` (0, greedy, reads as 1)."""
    logits = hidden.float() @ weight[ids.to(weight.device)].float().T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature > 0:
        logits = logits / temperature
    probs, at = logits.softmax(-1).topk(min(k, len(ids)), dim=-1)
    return Hints(ids.to(at.device)[at].cpu().tolist(), probs.cpu().tolist())


@dataclass
class PendingPromptHints:
    """A sequence's prompt rows, gathered over its prefill's steps until its first verdict carries them."""

    start: int  # row 0 follows the prompt token at this position (the first one the prefill computes)
    candidates: torch.Tensor
    hints: Hints = field(default_factory=lambda: Hints([], []))

    def add(self, hidden: torch.Tensor, weight: torch.Tensor, k: int, softcap: float | None,
            temperature: float) -> None:
        """The rows of the next prompt positions, from their final hidden states."""
        more = prompt_hints(hidden, weight, self.candidates, k, softcap, temperature)
        self.hints.ids += more.ids
        self.hints.probs += more.probs
