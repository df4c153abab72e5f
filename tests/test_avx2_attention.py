"""The verifier's own attention kernel for AVX2/FMA CPUs (cloud/avx2_attention.py): one sequence's queries over its
slots of the paged KV pool, read in place, against float64 for the shapes a pass has (one token to a tree, a few
keys to many, grouped query heads, masks) at either thread count; each row's result independent of the rows beside
it; and torch's products where the kernel is turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specedge.cloud import avx2_attention
from specedge.cloud.attention import SeqSlice, StepBatch, paged_attention
from specedge.cloud.kv_pool import KVBlockPool

pytestmark = pytest.mark.skipif(not avx2_attention.available(), reason="no AVX2/FMA CPU or no C++ compiler here")


def float64_attention(q, k_cache, v_cache, slots, mask, scale):
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, 1)  # [C, H, D]
    values = v_cache[slots].double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("nhd,chd->nhc", q.double(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("nhc,chd->nhd", scores.softmax(-1), values).reshape(len(q), -1)


def case(seed: int, n: int, heads: int, kv_heads: int, head_dim: int, ctx: int, masked: bool, pool_slots: int = 2048):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(pool_slots, generator=gen)[:ctx]  # scattered, as blocks of a long-lived pool are
    q = torch.randn(n, heads, head_dim, generator=gen) * 2
    mask = None
    if masked:
        mask = torch.rand(n, ctx, generator=gen) > 0.4
        mask[:, 0] = True  # every row sees at least its root
    return q, k_cache, v_cache, slots, mask


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (2, 2, 32), (8, 2, 128)])
def test_matches_float64_for_the_shapes_a_pass_has(threads: int, heads: int, kv_heads: int, head_dim: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, ctx, masked in [(1, 1, False), (1, 5, False), (2, 3, True), (3, 4, True), (9, 417, True),
                               (1, 903, False), (17, 130, True), (5, 64, False)]:
            q, k_cache, v_cache, slots, mask = case(n * ctx + head_dim, n, heads, kv_heads, head_dim, ctx, masked)
            got = avx2_attention.attention(q, k_cache, v_cache, slots, mask, head_dim**-0.5)
            want = float64_attention(q, k_cache, v_cache, slots, mask, head_dim**-0.5)
            assert got.shape == (n, heads * head_dim) and got.dtype == torch.float32
            assert (got.double() - want).abs().max() < 2e-6, (n, ctx, masked)
    finally:
        torch.set_num_threads(before)


def test_masked_slots_count_for_nothing():
    q, k_cache, v_cache, slots, mask = case(3, 6, 9, 3, 64, 200, masked=True)
    mask[:, 150:] = False
    far = k_cache.clone(), v_cache.clone()
    far[0][slots[150:]] = 1e4  # what they hold must not leak into any row
    far[1][slots[150:]] = -1e4
    assert torch.equal(avx2_attention.attention(q, k_cache, v_cache, slots, mask, 0.125),
                       avx2_attention.attention(q, *far, slots, mask, 0.125))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads: int):
    """So a node verified in a tree of any size gets the bits a pass of that node alone would."""
    q, k_cache, v_cache, slots, mask = case(4, 13, 9, 3, 64, 301, masked=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = avx2_attention.attention(q, k_cache, v_cache, slots, mask, 0.125)
        for i in range(13):
            alone = avx2_attention.attention(q[i : i + 1], k_cache, v_cache, slots, mask[i : i + 1], 0.125)
            assert torch.equal(together[i], alone[0])
            beside = avx2_attention.attention(q[max(0, i - 4) : i + 1], k_cache, v_cache, slots,
                                              mask[max(0, i - 4) : i + 1], 0.125)
            assert torch.equal(together[i], beside[-1])
    finally:
        torch.set_num_threads(before)


def test_a_rows_result_does_not_depend_on_the_thread_count():
    """One thread sweeps every kv head at once, more split them: the same operations on each row either way."""
    q, k_cache, v_cache, slots, mask = case(6, 7, 9, 3, 64, 333, masked=True)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(avx2_attention.attention(q, k_cache, v_cache, slots, mask, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_paged_attention_takes_the_kernel_and_agrees_with_torchs_products(monkeypatch):
    """The same step through the pool both ways: a cached context and a tree of new tokens, and a second sequence
    in the batch."""
    pool = KVBlockPool(KVBlockPool.block_bytes(16, 1, 3, 64) * 32, block_size=16, num_layers=1, num_kv_heads=3,
                       head_dim=64)
    gen = torch.Generator().manual_seed(5)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    seqs, new_slots = [], []
    for start, ctx_first, cached in [(0, 0, 100), (4, 300, 37)]:
        ctx = torch.arange(ctx_first, ctx_first + cached + 4)
        mask = torch.cat([torch.ones(4, cached, dtype=torch.bool), tree_mask], 1)
        seqs.append(SeqSlice(start, start + 4, ctx, mask, torch.arange(cached, cached + 4),
                             torch.arange(cached + 4)))
        new_slots.append(ctx[-4:])
    batch = StepBatch(torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), torch.cat(new_slots), seqs)
    q, k, v = torch.randn(8, 9, 64, generator=gen), torch.randn(8, 3, 64, generator=gen), torch.randn(8, 3, 64,
                                                                                                     generator=gen)
    calls = []
    real = avx2_attention.attention
    monkeypatch.setattr(avx2_attention, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    by_kernel = paged_attention(q, k, v, 0, pool, batch, 0.125)
    assert len(calls) == 2
    monkeypatch.setattr(avx2_attention, "usable_for", lambda *a: False)
    by_torch = paged_attention(q, k, v, 0, pool, batch, 0.125)
    assert len(calls) == 2
    assert torch.allclose(by_kernel, by_torch, atol=1e-5)


@pytest.mark.skipif(not avx2_attention.available() or avx2_attention.isa() < 2, reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256)])
def test_avx512_gives_avx2s_bits(heads: int, kv_heads: int, head_dim: int):
    """The values' weighted sums in AVX-512 registers, up to six rows a read: each dimension the same FMAs in the same
    order as on AVX2."""
    for n, ctx in [(1, 37), (7, 300), (17, 130)]:
        q, k_cache, v_cache, slots, mask = case(n + ctx, n, heads, kv_heads, head_dim, ctx, masked=True)
        by = [avx2_attention.attention(q, k_cache, v_cache, slots, mask, 0.125, instructions=i) for i in (2, 1)]
        assert torch.equal(*by), (n, ctx)


def causal_mask(n: int, ctx: int) -> torch.Tensor:
    """[n, ctx]: the last n slots a chain, each row seeing the cached slots before them and its own and earlier."""
    return torch.cat([torch.ones(n, ctx - n, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))], 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,ctx", [(1, 1), (5, 5), (70, 70), (100, 260), (49, 49)])
def test_a_causal_chain_reads_no_key_past_its_own(threads: int, n: int, ctx: int):
    """A prompt's chain (causal=True) matches float64 with its mask, a window's mask still applies, and what the slots
    after a row's own hold does not change it (the kernel reads them only up to its block's last row's)."""
    q, k_cache, v_cache, slots, _ = case(n * 7 + ctx, n, 9, 3, 64, ctx, masked=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = float64_attention(q, k_cache, v_cache, slots, causal_mask(n, ctx), 0.125)
        got = avx2_attention.attention(q, k_cache, v_cache, slots, None, 0.125, causal=True)
        assert (got.double() - want).abs().max() < 2e-6
        window = causal_mask(n, ctx) & (torch.rand(n, ctx, generator=torch.Generator().manual_seed(n)) > 0.3)
        window[torch.arange(n), ctx - n + torch.arange(n)] = True  # each row sees its own slot
        want = float64_attention(q, k_cache, v_cache, slots, window, 0.125)
        got = avx2_attention.attention(q, k_cache, v_cache, slots, window, 0.125, causal=True)
        assert (got.double() - want).abs().max() < 2e-6
    finally:
        torch.set_num_threads(before)
    plain = avx2_attention.attention(q, k_cache, v_cache, slots, None, 0.125, causal=True)
    for row in range(0, n, 7):  # what the slots after a row's own hold counts for nothing in it
        far = k_cache.clone(), v_cache.clone()
        far[0][slots[ctx - n + row + 1 :]] = 1e4
        far[1][slots[ctx - n + row + 1 :]] = -1e4
        assert torch.equal(avx2_attention.attention(q, *far, slots, None, 0.125, causal=True)[row], plain[row])


def test_a_causal_chain_longer_than_its_slots_is_refused():
    q, k_cache, v_cache, slots, _ = case(1, 5, 9, 3, 64, 4, masked=False)
    with pytest.raises(ValueError, match="causal chain of 5 rows over 4 slots"):
        avx2_attention.attention(q, k_cache, v_cache, slots, None, 0.125, causal=True)


@pytest.mark.parametrize("cached", [0, 50])
def test_a_prompts_chain_goes_through_the_kernel_causally_and_agrees_with_torch(monkeypatch, cached: int):
    """A prefill of 70 tokens after `cached` ones, the first draft's two nodes after it: the chain by the kernel's
    causal path, the nodes by its masked one; torch's (SDPA's flash kernel from key 0, masked products after a cached
    prefix) agree."""
    from specedge.cloud.tree_mask import step_mask
    from specedge.common.draft_tree import DraftTree

    pool = KVBlockPool(KVBlockPool.block_bytes(16, 1, 3, 64) * 16, block_size=16, num_layers=1, num_kv_heads=3,
                       head_dim=64)
    gen = torch.Generator().manual_seed(9)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    chain, tree = 70, DraftTree([5, 6], [-1, 0])
    n = chain + len(tree)
    ctx = torch.arange(cached + n)
    seq = SeqSlice(0, n, ctx, step_mask(cached, chain, tree), torch.arange(cached, cached + n),
                   torch.arange(cached + n), causal_rows=chain)
    batch = StepBatch(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), ctx[cached:], [seq])
    q, k, v = (torch.randn(n, h, 64, generator=gen) for h in (9, 3, 3))
    calls = []
    real = avx2_attention.attention
    monkeypatch.setattr(avx2_attention, "attention", lambda *a, **kw: calls.append(kw.get("causal")) or real(*a, **kw))
    by_kernel = paged_attention(q, k, v, 0, pool, batch, 0.125)
    assert calls == [True, None]
    monkeypatch.setattr(avx2_attention, "usable_for", lambda *a: False)
    by_torch = paged_attention(q, k, v, 0, pool, batch, 0.125)
    assert torch.allclose(by_kernel, by_torch, atol=1e-5)


def test_turned_off_by_the_environment_attention_uses_torch():
    code = "from specedge.cloud import avx2_attention; print(avx2_attention.available())"
    env = {**os.environ, "SPECEDGE_CPU_ATTENTION": "torch"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
