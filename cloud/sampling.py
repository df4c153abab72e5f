"""The target distribution that sampling parameters define (the same warpers as transformers), and the
random numbers a sequence samples with."""

from __future__ import annotations

import hashlib
import math
import os
import struct
from dataclasses import dataclass

import torch

from specedge.common.params import SamplingParams


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


@dataclass(frozen=True)
class Draws:
    """The uniform numbers a sequence samples with, each a function of (seed, position, index) alone.

    `position` is the index in prompt + output of the token being chosen; `index` tells apart the numbers
    one position needs (0: the token drawn from the target, 1..: one per proposed child in rejection
    sampling). Nothing depends on how many numbers were drawn before, so a session replayed elsewhere
    (prompt + committed tokens, after a failover or a migration) draws exactly what it would have drawn.
    With the matching rule (a tree without proposals) the committed token at each position is then the
    one plain sampling with the same seed gives, whatever the drafts were.
    """

    seed: int

    @classmethod
    def for_seed(cls, seed: int | None) -> Draws:
        """Draws of `seed`, or of a fresh random seed when it is None."""
        return cls(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def uniform(self, position: int, index: int = 0) -> float:
        """A uniform number in [0, 1) with 53 random bits."""
        key = struct.pack("<QQQ", self.seed & _MASK64, position & _MASK64, index & _MASK64)
        word = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return (word >> 11) * 2.0**-53


_MASK64 = (1 << 64) - 1
