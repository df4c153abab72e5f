"""AffinityIndex: which prompt blocks each verifier's prefix cache holds, exactly as the verifier reports
them (WatchCache: a snapshot, then stored and evicted hashes), so a placement knows its cache hits rather
than guessing them from the text it routed before."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specedge.common.block_hash import prompt_block_hashes


class AffinityIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}

    def replace(self, address: str, block_size: int, hashes: Iterable[int]) -> None:
        self._held[address] = set(hashes)
        self._block_size[address] = block_size

    def update(self, address: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        held = self._held.get(address)
        if held is not None:  # else: a change for a verifier forgotten since; its next snapshot counts
            held.update(stored)
            held.difference_update(removed)

    def forget(self, address: str) -> None:
        self._held.pop(address, None)
        self._block_size.pop(address, None)

    def blocks(self, address: str) -> int:
        return len(self._held.get(address, ()))

    def cached_tokens(self, addresses: Iterable[str], prompt_ids: Sequence[int]) -> dict[str, int]:
        """Per verifier, the prompt tokens whose KV its cache holds (its longest cached prefix of blocks)."""
        hashes_by_size: dict[int, list[int]] = {}
        cached = {}
        for address in addresses:
            held, size = self._held.get(address), self._block_size.get(address)
            if not held or size is None:
                cached[address] = 0
                continue
            if size not in hashes_by_size:
                hashes_by_size[size] = prompt_block_hashes(prompt_ids, size)
            blocks = 0
            for h in hashes_by_size[size]:
                if h not in held:
                    break
                blocks += 1
            cached[address] = blocks * size
        return cached
