"""Sampling parameters and the target distribution they define (the same warpers as transformers)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        # Written as `not (ok)` so that NaN is rejected too.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] (float32) after temperature, top-k and top-p, exactly as transformers applies them."""
    if params.temperature <= 0:
        raise ValueError("target_probs needs temperature > 0; greedy decoding uses the argmax of the logits")
    # transformers' generate casts the logits to float32 before its warpers; so do we.
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)  # ties with the k-th score are kept, as in HF
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores.softmax(dim=-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from `seed`, or from fresh OS entropy when `seed` is None."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return generator
