"""Attention over the paged KV pool for a ragged batch of sequences, each with its own tree mask."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specedge.cloud import avx2_attention
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.padded_attention import PaddedGroup, pad_groups, padded_attention


@dataclass
class SeqSlice:
    """One sequence's part of a step: rows [start, end) of the batch attend to `ctx_slots`."""

    start: int
    end: int
    ctx_slots: torch.Tensor  # [C] slots of cached tokens then the new tokens, in that order
    mask: torch.Tensor | None  # [n, C] bool, None when every row may see every slot
    query_pos: torch.Tensor  # [n]
    key_pos: torch.Tensor  # [C]
    causal_rows: int = 0  # leading rows that are a causal chain after the cached context (a prompt's prefill)
    _bias: dict[tuple, torch.Tensor | None] = field(default_factory=dict)  # masks by their form, made once

    def __post_init__(self) -> None:
        # A sequence's blocks are often consecutive in the pool; then its context is a view, not a gather.
        slots = self.ctx_slots.numpy()
        first = int(slots[0])
        contiguous = int(slots[-1]) - first == len(slots) - 1 and bool((np.diff(slots) == 1).all())
        self.ctx_range = (first, first + len(self.ctx_slots)) if contiguous else None

    def context(self, cache: torch.Tensor) -> torch.Tensor:
        """This sequence's context rows [C, KVH, D] of one layer's K or V."""
        if self.ctx_range is not None:
            return cache[self.ctx_range[0] : self.ctx_range[1]]
        return cache.index_select(0, self.ctx_slots)  # ~3x faster than advanced indexing on the CPU

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        """The mask, restricted to keys less than `window` positions behind the query (None = no window)."""
        if window is None:
            return self.mask
        near = (self.query_pos[:, None] - self.key_pos[None, :]) < window
        if bool(near.all()):
            return self.mask
        return near if self.mask is None else near & self.mask

    def attention_bias(self, window: int | None, group: int, first_row: int = 0) -> torch.Tensor | None:
        """The mask of rows [first_row, n) as an additive bias [group * rows, C] (0 or -inf), rows repeated for
        each query head of a kv group, so that masking costs nothing beyond the score matmul (`baddbmm`)."""
        key = (window, group, first_row)
        if key not in self._bias:
            mask = self.window_mask(window)
            if mask is None:
                self._bias[key] = None
            else:
                mask = mask[first_row:]
                bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, -math.inf)
                self._bias[key] = bias.repeat(group, 1)
        return self._bias[key]

    def visible(self, window: int | None, first_row: int = 0) -> torch.Tensor | None:
        """The mask of rows [first_row, n) as bytes (1 = visible), what the CPU's attention kernel reads; None when
        all is visible."""
        key = ("visible", window, first_row)
        if key not in self._bias:
            mask = self.window_mask(window)
            self._bias[key] = None if mask is None else mask[first_row:].to(torch.uint8).contiguous()
        return self._bias[key]

    @property
    def cached(self) -> int:
        """Context tokens before this step's."""
        return len(self.ctx_slots) - (self.end - self.start)

    def chain_rows(self) -> int:
        """Leading rows long enough a causal chain to be computed as one (`_CHAIN_FROM`)."""
        return self.causal_rows if self.causal_rows >= _CHAIN_FROM else 0

    def flash_rows(self, window: int | None) -> int:
        """Leading rows that plain causal attention can serve: a long enough chain from key 0 no window cuts."""
        rows = self.chain_rows()
        return rows if self.cached == 0 and (window is None or rows <= window) else 0

    def chain_visible(self, window: int | None) -> torch.Tensor | None:
        """`visible` for the chain's rows over the slots up to its last row's (what the window hides; None: nothing)."""
        key = ("chain", window)
        if key not in self._bias:
            mask = self.window_mask(window) if window is not None else None
            rows = self.chain_rows()
            self._bias[key] = None if mask is None else mask[:rows, : self.cached + rows].to(torch.uint8).contiguous()
        return self._bias[key]


_CHAIN_FROM = 64  # below this, a causal chain goes through the general path with the rest


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_slots: torch.Tensor  # [T] where each new token's K/V is written
    seqs: list[SeqSlice]
    padded: list[PaddedGroup] | None = None  # off the CPU: the sequences as padded groups (set by `to`)

    def to(self, device: torch.device, logits_rows: torch.Tensor, padded: bool | None = None
           ) -> tuple[StepBatch, torch.Tensor]:
        """This batch and its logits rows on `device`. Off the CPU (or with `padded`, which tests use to check
        that layout on the CPU) its sequences become padded groups (cloud/padded_attention.py), and everything
        goes over in one transfer per dtype."""
        if not (device.type != "cpu" if padded is None else padded):
            return self, logits_rows
        groups = pad_groups(self.seqs)
        moved = to_device([self.input_ids, self.positions, self.new_slots, logits_rows]
                          + [t for g in groups for t in g.tensors()], device)
        rest = iter(moved[4:])
        groups = [PaddedGroup(*(next(rest) for _ in g.tensors())) for g in groups]
        return StepBatch(*moved[:3], [], groups), moved[3]


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The tensors on `device` through one pinned buffer and one copy per dtype: a step's inputs are a dozen
    small tensors, and each copy of its own costs tens of microseconds."""
    moved: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        flat = [tensors[i].reshape(-1) for i in members]
        staged = torch.empty(sum(len(f) for f in flat), dtype=dtype, pin_memory=device.type == "cuda")
        torch.cat(flat, out=staged)
        parts = staged.to(device, non_blocking=True).split([len(f) for f in flat])
        for i, part in zip(members, parts):
            moved[i] = part.view(tensors[i].shape)
    return moved


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: KVBlockPool,
    batch: StepBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens -> attention output [T, H*D].

    The new K/V are written to the pool first, so each sequence reads its whole context from the pool.
    """
    pool.k[layer, batch.new_slots] = k
    pool.v[layer, batch.new_slots] = v
    if batch.padded is not None:
        return padded_attention(q, pool.k[layer], pool.v[layer], batch.padded, scale, window)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    kernel = avx2_attention.usable_for(q, pool.k)
    for s in batch.seqs:
        chain = s.chain_rows() if kernel else s.flash_rows(window)  # a prompt's chain: its rows as one causal product
        first = s.start + chain
        by_kernel = kernel and (s.end - first) * len(s.ctx_slots) <= _SDPA_FROM  # it reads the pool in place
        if (chain and not kernel) or (first < s.end and not by_kernel):
            keys = s.context(pool.k[layer]).transpose(0, 1)  # [KVH, C, D] (a view where the slots are consecutive)
            values = s.context(pool.v[layer]).transpose(0, 1)
        if chain and kernel:  # each block of its rows reads the keys up to its last row's only
            avx2_attention.attention(q[s.start : first], pool.k[layer], pool.v[layer], s.ctx_slots[: s.cached + chain],
                                     s.chain_visible(window), scale, out=out[s.start : first], causal=True)
        elif chain:  # without the kernel, SDPA's flash kernel, ~3x faster than masked scores at 800 tokens here
            # (it takes the flash path only for 4-d inputs with as many kv heads as query heads)
            o = F.scaled_dot_product_attention(q[None, s.start : first].transpose(1, 2),
                                               keys[None, :, :chain].repeat_interleave(group, 1),
                                               values[None, :, :chain].repeat_interleave(group, 1),
                                               is_causal=True, scale=scale)
            out[s.start : first] = o[0].transpose(0, 1).reshape(chain, -1)
        if first < s.end and by_kernel:
            avx2_attention.attention(q[first : s.end], pool.k[layer], pool.v[layer], s.ctx_slots,
                                     s.visible(window, first - s.start), scale, out=out[first : s.end])
        elif first < s.end:
            out[first : s.end] = grouped_attention(q[first : s.end], keys, values,
                                                   s.attention_bias(window, group, first - s.start), scale)
    return out


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [n, H, D] over keys/values [KVH, C, D] (query head h reads kv head h // (H / KVH)) -> [n, H*D].

    `bias` [group * n, C] is added to the scores (0 = visible, -inf = masked), None when all is visible.
    The query heads of a group are stacked so each kv head is read once, without repeating K/V. Measured
    here on SmolLM2 shapes (C = 500): 0.11 ms for one query and 0.6 ms for 16, against 1.2 and 1.9 ms for
    `F.scaled_dot_product_attention(..., enable_gqa=True)`, whose CPU path copies K/V per query head.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, ctx = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    if n * ctx > _SDPA_FROM:  # long prefill: let SDPA avoid materialising every score
        mask = None if bias is None else bias[:n] == 0
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1).reshape(n, num_heads * head_dim)
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    if bias is None:
        scores = torch.matmul(qg, keys.transpose(1, 2)).mul_(scale)
    else:
        bias = bias.to(qg.dtype).expand(num_kv_heads, -1, -1)
        scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=scale)
    o = torch.matmul(scores.softmax(dim=-1), values)  # [KVH, group * n, D]
    return o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads * head_dim)


_SDPA_FROM = 1 << 18  # query rows x context length beyond which scores would take > 1 MiB per head


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D] (broadcast over heads), computed in float32 and cast to `dtype` as transformers does."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                               / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
