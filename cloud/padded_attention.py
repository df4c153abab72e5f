"""Attention over the paged pool on a GPU: a step's sequences padded into a few batched SDPA calls.

On the CPU each sequence runs its own small kernels (cloud/attention.py), which costs nothing there. On a
GPU every kernel launch costs microseconds whatever its size, so a step of 64 sessions must not launch
64 attentions per layer. Sequences are grouped by their number of new tokens (powers of two, so that
padding wastes at most half of a group's rows), and each group is one `scaled_dot_product_attention`
call over its sequences' contexts gathered from the pool ([B, KVH, C, D]) with one additive mask that
holds every sequence's tree mask, its padding and, for sliding-window layers, the window.

The query heads of a kv group are stacked as rows (as on the CPU), so K/V are read once per kv head and
never repeated; the mask is repeated over the group's rows instead, once per step. Everything here is
built on the host once per step and copied to the device in a few transfers; layers only index it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# Keys per sequence are padded to a multiple of this: the memory-efficient SDPA kernel wants its mask rows
# aligned, and a coarser step keeps a decoding session's shapes (hence its CUDA graph) the same for longer.
_ALIGN = 64
LONG_ROWS = 64  # a sequence with more new tokens (a prefill) gets a group of its own


@dataclass
class PaddedGroup:
    """B sequences of at most n new tokens each, over at most C context slots each."""

    rows: torch.Tensor  # [R] rows of the step's batch that belong to this group
    seq_of_row: torch.Tensor  # [R] which of the B sequences each row is
    row_in_seq: torch.Tensor  # [R] which of its n padded rows
    gather: torch.Tensor  # [B * C] pool slots of each sequence's context, padded with slot 0
    visible: torch.Tensor  # [B, n, C] bool: the sequences' masks; padded rows see key 0 only
    query_pos: torch.Tensor  # [B, n]
    key_pos: torch.Tensor  # [B, C]
    _bias: dict[tuple, torch.Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int]:
        b, n, c = self.visible.shape
        return b, n, c

    def bias(self, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask [B, 1, group * n, C] (0 visible, -inf hidden) for one kind of layer."""
        key = (window, group, dtype)
        if key not in self._bias:
            visible = self.visible
            if window is not None:
                visible = visible & ((self.query_pos[:, :, None] - self.key_pos[:, None, :]) < window)
                visible[:, :, 0] |= ~visible.any(-1)  # padded rows keep a key, so their (unused) softmax is finite
            b, n, c = self.shape
            rows = visible[:, None].expand(b, group, n, c).reshape(b, 1, group * n, c)
            self._bias[key] = torch.zeros(rows.shape, dtype=dtype, device=rows.device).masked_fill_(~rows, -math.inf)
        return self._bias[key]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The inputs, in field order (the masks computed from them aside)."""
        return self.rows, self.seq_of_row, self.row_in_seq, self.gather, self.visible, self.query_pos, self.key_pos

    def clone(self) -> PaddedGroup:
        return PaddedGroup(*(t.clone() for t in self.tensors()))


def pad_groups(seqs: list) -> list[PaddedGroup]:
    """The groups of a step's sequences (attention.SeqSlice, host tensors), built on the host."""
    buckets: dict[int, list] = {}
    for s in seqs:
        n = s.end - s.start
        key = -s.start if n > LONG_ROWS else 1 << (n - 1).bit_length()  # long ones alone
        buckets.setdefault(key, []).append(s)
    return [_group(members) for members in buckets.values()]


def _group(seqs: list) -> PaddedGroup:
    b = len(seqs)
    n = max(s.end - s.start for s in seqs)
    c = -(-max(len(s.ctx_slots) for s in seqs) // _ALIGN) * _ALIGN
    gather = np.zeros((b, c), dtype=np.int64)  # numpy: filled row by row, ~5x cheaper than torch's indexing
    visible = np.zeros((b, n, c), dtype=np.bool_)
    visible[:, :, 0] = True  # padded rows
    query_pos = np.zeros((b, n), dtype=np.int64)
    key_pos = np.zeros((b, c), dtype=np.int64)
    rows, seq_of_row, row_in_seq = [], [], []
    for i, s in enumerate(seqs):
        rows_i, ctx = s.end - s.start, len(s.ctx_slots)
        gather[i, :ctx] = s.ctx_slots.numpy()
        visible[i, :rows_i, :ctx] = True if s.mask is None else s.mask.numpy()
        query_pos[i, :rows_i] = s.query_pos.numpy()
        key_pos[i, :ctx] = s.key_pos.numpy()
        rows.append(np.arange(s.start, s.end))
        seq_of_row.append(np.full(rows_i, i))
        row_in_seq.append(np.arange(rows_i))
    arrays = (np.concatenate(rows), np.concatenate(seq_of_row), np.concatenate(row_in_seq), gather.reshape(-1),
              visible, query_pos, key_pos)
    return PaddedGroup(*map(torch.from_numpy, arrays))


def padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[PaddedGroup],
                     scale: float, window: int | None) -> torch.Tensor:
    """q [T, H, D] of the step's new tokens over one layer's pool k/v [slots, KVH, D] -> [T, H * D]."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
    for g in groups:
        b, n, c = g.shape
        qp = q.new_zeros(b, n, num_heads, head_dim)
        qp[g.seq_of_row, g.row_in_seq] = q[g.rows]
        qp = qp.view(b, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(
            b, num_kv_heads, group * n, head_dim)
        keys = k_cache.index_select(0, g.gather).view(b, c, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, g.gather).view(b, c, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=g.bias(window, group, q.dtype), scale=scale)
        o = o.view(b, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4).reshape(b, n, num_heads * head_dim)
        out[g.rows] = o[g.seq_of_row, g.row_in_seq]
    return out
