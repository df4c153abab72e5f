"""A BPE model's merges as a packed hash table: two int64 arrays instead of a dict of Python ints.

Gemma 3 has 515k merges. As a dict of (left, right) -> (rank, merged) ints they take ~55 MB and ~0.1 s
to build at every start; as this table, 16 MB, stored as it is in the edge's tokenizer cache and loaded
in milliseconds. A lookup probes from a multiplicative hash of the pair, linearly, at a load factor of at
most one half: ~1.5 probes where the pair merges, ~2.5 where it does not. It costs ~3x a dict lookup,
which the encoder's word cache hides for all but new words.
"""

from __future__ import annotations

import numpy as np

_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: bits 12-47 of key * this are well mixed
_SHIFT = 12
EMPTY = -1


class MergeTable:
    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        """`keys`: left * vocab size + right per slot (EMPTY where none); `values`: rank * vocab size +
        merged id. Their length is a power of two."""
        if len(keys) != len(values) or len(keys) & (len(keys) - 1):
            raise ValueError("a merge table's arrays must have the same power-of-two length")
        self.keys_array, self.values_array = keys, values
        self._keys, self._values = memoryview(keys), memoryview(values)  # int per item, without numpy scalars
        self._mask = len(keys) - 1

    @classmethod
    def build(cls, merges: np.ndarray, size: int) -> MergeTable:
        """From [n, 3] rows (left id, right id, merged id) in rank order; a pair listed twice keeps its
        later rank, as the library's map does."""
        keys = merges[:, 0].astype(np.int64) * size + merges[:, 1]
        values = np.arange(len(merges), dtype=np.int64) * size + merges[:, 2]
        last = len(keys) - 1 - np.unique(keys[::-1], return_index=True)[1]  # each key's last row
        keys, values = keys[last], values[last]
        slots = 1 << max(1, int(2 * max(len(keys), 1) - 1).bit_length())
        table_keys = np.full(slots, EMPTY, dtype=np.int64)
        table_values = np.zeros(slots, dtype=np.int64)
        want = home_slots(keys, slots)
        pending = np.arange(len(keys))
        while len(pending):  # linear probing, all pending keys a step at a time
            slot = want[pending]
            free = table_keys[slot] == EMPTY
            first = np.zeros(len(pending), dtype=bool)
            _, winners = np.unique(np.where(free, slot, -1), return_index=True)
            first[winners] = True
            placed = free & first
            table_keys[slot[placed]] = keys[pending[placed]]
            table_values[slot[placed]] = values[pending[placed]]
            pending = pending[~placed]
            want[pending] = (want[pending] + 1) & (slots - 1)
        return cls(table_keys, table_values)

    def get(self, key: int) -> int:
        """The packed value of a key, EMPTY if the pair does not merge."""
        mask, keys = self._mask, self._keys
        slot = ((key * _MULTIPLIER) >> _SHIFT) & mask
        while True:
            found = keys[slot]
            if found == key:
                return self._values[slot]
            if found == EMPTY:
                return EMPTY
            slot = (slot + 1) & mask

    def items(self) -> list[tuple[int, int]]:
        used = self.keys_array != EMPTY
        return list(zip(self.keys_array[used].tolist(), self.values_array[used].tolist()))


def home_slots(keys: np.ndarray, slots: int) -> np.ndarray:
    """Where each key's probe starts: bits 12 and up of key * multiplier (exact in uint64 arithmetic, since
    they lie below bit 64), as `MergeTable.get` computes with Python ints."""
    product = keys.astype(np.uint64) * np.uint64(_MULTIPLIER)
    return ((product >> np.uint64(_SHIFT)) & np.uint64(slots - 1)).astype(np.int64)
