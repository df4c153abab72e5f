"""Attention over the paged KV pool for a ragged batch of sequences, each with its own tree mask."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specedge.cloud.kv_pool import KVBlockPool


@dataclass
class SeqSlice:
    """One sequence's part of a step: rows [start, end) of the batch attend to `ctx_slots`."""

    start: int
    end: int
    ctx_slots: torch.Tensor  # [C] slots of cached tokens then the new tokens, in that order
    mask: torch.Tensor | None  # [n, C] bool, None when every row may see every slot
    query_pos: torch.Tensor  # [n]
    key_pos: torch.Tensor  # [C]
    _window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor | None:
        """The mask restricted to keys less than `window` positions behind the query."""
        if window not in self._window_masks:
            near = (self.query_pos[:, None] - self.key_pos[None, :]) < window
            if bool(near.all()):
                self._window_masks[window] = self.mask
            else:
                self._window_masks[window] = near if self.mask is None else near & self.mask
        return self._window_masks[window]


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_slots: torch.Tensor  # [T] where each new token's K/V is written
    seqs: list[SeqSlice]


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
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    for s in batch.seqs:
        keys = pool.k[layer, s.ctx_slots].transpose(0, 1)  # [KVH, C, D]
        values = pool.v[layer, s.ctx_slots].transpose(0, 1)
        mask = s.mask if window is None else s.window_mask(window)
        o = F.scaled_dot_product_attention(
            q[s.start : s.end].transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[s.start : s.end] = o.transpose(0, 1).reshape(s.end - s.start, -1)
    return out


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, D], broadcast over heads


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
