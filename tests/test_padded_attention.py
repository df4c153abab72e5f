"""The padded groups that attention runs in off the CPU (cloud/padded_attention.py) give the same logits as
the CPU's per-sequence path. Checked here on the CPU, by building the GPU's layout for a CPU batch, so that
CI (which has no GPU) covers the layout's logic: buckets by new tokens, a prefill alone, padded rows and
keys, tree masks, and gemma's sliding window."""

from __future__ import annotations

import random

import pytest
import torch

from specedge.cloud import attention
from specedge.cloud.engine import Engine
from specedge.cloud.padded_attention import LONG_ROWS, pad_groups
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from tiny_models import tiny_gemma3, tiny_llama


def padded_on_the_cpu(monkeypatch) -> None:
    """The engine's batches take the GPU's layout (and its packed transfer) on the CPU from now on."""
    to = attention.StepBatch.to
    monkeypatch.setattr(attention.StepBatch, "to", lambda batch, device, rows: to(batch, device, rows, padded=True))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_padded_groups_give_the_per_sequence_logits(arch, monkeypatch):
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 5, 13, 21, 2 * LONG_ROWS)]
    trees = [DraftTree([], []), DraftTree([5, 6, 7], [-1, -1, 0]), DraftTree([9], [-1]),
             DraftTree([3, 4, 8, 2, 6], [-1, 0, 0, 1, 3]), DraftTree([1, 2], [-1, -1])]
    outputs = []
    for padded in (False, True):
        hf = tiny_llama() if arch == "llama" else tiny_gemma3(sliding_window=8)
        engine = Engine.from_hf_model(hf, kv_pool_bytes=4 << 20, block_size=4)
        seqs = [engine.add_sequence(p, SamplingParams()) for p in prompts]
        engine.step(list(zip(seqs, trees)))  # prefills; the next steps verify trees over cached contexts
        if padded:
            padded_on_the_cpu(monkeypatch)
        outputs.append(engine.forward(list(zip(seqs, trees))))
    for solo, grouped in zip(*outputs):
        assert (solo - grouped).abs().max().item() <= 1e-4


def test_sequences_are_grouped_by_new_tokens_and_a_prefill_is_alone():
    engine = Engine.from_hf_model(tiny_llama(), kv_pool_bytes=4 << 20, block_size=4)
    seqs = [engine.add_sequence(list(range(2, 2 + n)), SamplingParams()) for n in (1, 2, 3, 4, 100, 70)]
    for s in seqs:
        engine.pool.reserve(s.seq_id, len(s.token_ids))
    batch, _ = engine._build_batch([(s, DraftTree.empty(), len(s.token_ids)) for s in seqs], logits_for=len(seqs))
    groups = pad_groups(batch.seqs)
    assert sorted(g.shape[:2] for g in groups) == [(1, 1), (1, 2), (1, 70), (1, 100), (2, 4)]
    assert sorted(torch.cat([g.rows for g in groups]).tolist()) == list(range(len(batch.input_ids)))
    assert all(g.shape[2] % 16 == 0 for g in groups)  # keys padded to the efficient kernel's alignment
