"""The target distribution that sampling parameters define (the same warpers as transformers), and the
random generator a sequence samples with."""

from __future__ import annotations

import math
import os

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


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from `seed`, or from fresh OS entropy when `seed` is None."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return generator
