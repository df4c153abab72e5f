"""Paged KV cache: one pre-allocated budget, fixed-size blocks, hash-chained prefix caching.

Every sequence owns a block table (list of block ids). A block that is full of *committed* tokens gets
a hash chained from its predecessor's, so another sequence whose prompt starts with the same tokens can
reuse it (reference counted). Blocks nobody references but that hold a hash stay cached and are evicted
least-recently-used when a fresh block is needed. Sequences only ever write past their committed length,
which always lies in a private block, so shared blocks are never written and need no copy-on-write.
`on_change` hears of every hash the pool starts or stops holding (routers place prompts by them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specedge.common.block_hash import chain_hash, prompt_block_hashes


class KVPoolExhausted(RuntimeError):
    """The pool cannot hold what was asked for; nothing was allocated. `retry_after_s` is set when the
    same request can succeed once other sessions have ended (the client may retry then)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks whose hash is registered (full and committed)
    last_hash: int | None = None


@dataclass(frozen=True)
class PoolStats:
    used: int  # referenced by at least one sequence
    cached: int  # unreferenced but holding a reusable prefix
    free: int
    block_size: int
    bytes_per_block: int


class KVBlockPool:
    def __init__(
        self,
        budget_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.bytes_per_block = self.block_bytes(block_size, num_layers, num_kv_heads, head_dim, dtype)
        self.num_blocks = budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes is smaller than one block ({self.bytes_per_block} bytes)"
            )
        slots = self.num_blocks * block_size
        # [layer, slot, kv_head, head_dim]; a slot is block_id * block_size + offset.
        self.k = torch.zeros(num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_ids: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.hash_to_block: dict[int, int] = {}
        self.tables: dict[int, BlockTable] = {}
        self.peak_used = 0  # most blocks referenced at once, transient draft-tree blocks included
        self.on_change: Callable[[list[int], list[int]], None] | None = None  # (stored, removed) hashes

    @staticmethod
    def block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V for one block of `block_size` tokens across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    # ---- sequences -------------------------------------------------------------------------------

    def open(self, seq_id: int, token_ids: list[int]) -> int:
        """Start a sequence and attach cached blocks for its longest cached prefix.

        Returns how many of `token_ids` already have KV. At least one token is always left to compute,
        because the caller needs the logits at the last prompt token.
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already open")
        table = BlockTable()
        self.tables[seq_id] = table
        for block_id, h in self._cached_prefix(token_ids):
            self._ref(block_id)
            table.blocks.append(block_id)
            table.num_hashed += 1
            table.last_hash = h
        return len(table.blocks) * self.block_size

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` `open` would find with KV now (the last token never)."""
        return len(self._cached_prefix(token_ids)) * self.block_size

    def _cached_prefix(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(block id, hash) of the cached blocks that hold the longest prefix of `token_ids`, the last
        token excluded."""
        found = []
        for i, h in enumerate(prompt_block_hashes(token_ids, self.block_size)):
            block_id = self.hash_to_block.get(h)
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # a hash collision
                break
            found.append((block_id, h))
        return found

    def close(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id)
        for block_id in reversed(table.blocks):  # tail first: it is the least likely to be shared
            self._unref(block_id)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make the sequence's table cover `num_tokens` slots, all-or-nothing."""
        table = self.tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table.blocks)
        if needed <= 0:
            return
        if needed > self.num_available():
            raise KVPoolExhausted(
                f"KV pool exhausted: need {needed} more blocks of {self.block_size} tokens, "
                f"{self.num_available()} of {self.num_blocks} available"
            )
        for _ in range(needed):
            table.blocks.append(self._take_block())

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Available blocks `reserve(seq_id, num_tokens)` would take."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables[seq_id].blocks))

    def blocks_to_open(self, token_ids: list[int], num_tokens: int) -> int:
        """Available blocks that opening a sequence of `token_ids` and reserving `num_tokens` slots would take:
        the new blocks, and the cached prefix blocks it would take back from the unreferenced ones."""
        prefix = self._cached_prefix(token_ids)
        revived = sum(self.blocks[block_id].ref_count == 0 for block_id, _ in prefix)
        return revived + max(0, self.blocks_for(num_tokens) - len(prefix))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` fits in the pool at all, with every other one gone."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        if keep < table.num_hashed:
            raise ValueError("cannot truncate into committed, hashed blocks")
        while len(table.blocks) > keep:
            self._unref(table.blocks.pop())

    def commit(self, seq_id: int, token_ids: list[int]) -> None:
        """Register the hashes of blocks now full of committed tokens (`token_ids` all have KV)."""
        table = self.tables[seq_id]
        full = min(len(token_ids) // self.block_size, len(table.blocks))
        stored = []
        for i in range(table.num_hashed, full):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(table.last_hash, chunk)
            block = self.blocks[table.blocks[i]]
            if h not in self.hash_to_block:
                block.hash, block.token_ids = h, chunk
                self.hash_to_block[h] = block.block_id
                stored.append(h)
            table.num_hashed, table.last_hash = i + 1, h
        if stored and self.on_change is not None:
            self.on_change(stored, [])

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Slot indices (into the layer tensors) of the sequence's token positions [start, end)."""
        first, last = start // self.block_size, -(-end // self.block_size)
        blocks = np.asarray(self.tables[seq_id].blocks[first:last], dtype=np.int64)  # numpy: ~5x cheaper here
        if len(blocks) < last - first:
            raise IndexError(f"sequence {seq_id} holds no slots for positions up to {end} (reserve them first)")
        slots = (blocks[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        return torch.from_numpy(slots[start - first * self.block_size : end - first * self.block_size])

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV at slots `src` to slots `dst` in every layer (used to compact an accepted path)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def drop_cached(self) -> int:
        """Forget every cached prefix no sequence uses (benchmarks: each run must prefill like the first)."""
        removed = []
        while self.cached_ids:
            block_id, _ = self.cached_ids.popitem(last=False)
            removed.append(self._forget(block_id))
            self.free_ids.append(block_id)
        if removed and self.on_change is not None:
            self.on_change([], removed)
        return len(removed)

    # ---- accounting ------------------------------------------------------------------------------

    def num_available(self) -> int:
        return len(self.free_ids) + len(self.cached_ids)

    def stats(self) -> PoolStats:
        free, cached = len(self.free_ids), len(self.cached_ids)
        return PoolStats(self.num_blocks - free - cached, cached, free, self.block_size, self.bytes_per_block)

    # ---- blocks ----------------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.cached_ids.popitem(last=False)  # evict the least recently used
            removed = self._forget(block_id)
            if self.on_change is not None:
                self.on_change([], [removed])
        self.blocks[block_id].ref_count = 1
        used = self.num_blocks - len(self.free_ids) - len(self.cached_ids)
        self.peak_used = max(self.peak_used, used)
        return block_id

    def _forget(self, block_id: int) -> int:
        """Drop a cached block's hash (it is about to be reused or freed); returns the hash."""
        block = self.blocks[block_id]
        removed = block.hash
        del self.hash_to_block[removed]
        block.hash, block.token_ids = None, ()
        return removed

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_ids[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.free_ids.append(block_id)
            else:
                self.cached_ids[block_id] = None
