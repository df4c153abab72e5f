"""AffinityIndex: which prompt blocks each verifier's prefix cache holds, exactly as the verifier reports
them (WatchCache: a snapshot, then stored and evicted hashes), so a placement knows its cache hits rather
than guessing them from the text it routed before.

Between placing a prompt and hearing that its blocks are stored (its prefill, seconds on a loaded CPU)
the index also *expects* them there, for up to `expect_s`: a second prompt with the same document that
arrives meanwhile follows the first instead of prefilling the document again elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from specedge.common.block_hash import prompt_block_hashes

EXPECT_S = 15.0


class AffinityIndex:
    def __init__(self, expect_s: float = EXPECT_S, clock=time.monotonic) -> None:
        self._held: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}
        self._expected: dict[str, dict[int, float]] = {}  # hash -> until when
        self.expect_s, self.clock = expect_s, clock

    def replace(self, address: str, block_size: int, hashes: Iterable[int]) -> None:
        self._held[address] = set(hashes)
        self._block_size[address] = block_size

    def update(self, address: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        held = self._held.get(address)
        if held is not None:  # else: a change for a verifier forgotten since; its next snapshot counts
            held.update(stored)
            held.difference_update(removed)
        expected = self._expected.get(address, {})
        for h in (*stored, *removed):  # reported: no longer a guess either way
            expected.pop(h, None)

    def forget(self, address: str) -> None:
        self._held.pop(address, None)
        self._block_size.pop(address, None)
        self._expected.pop(address, None)

    def expect(self, address: str, prompt_ids: Sequence[int]) -> None:
        """A prompt was placed there: count its blocks as held until the verifier reports them (or not)."""
        size = self._block_size.get(address)
        if size is None:
            return
        now = self.clock()
        expected = {h: until for h, until in self._expected.get(address, {}).items() if until > now}
        expected.update(dict.fromkeys(prompt_block_hashes(prompt_ids, size), now + self.expect_s))
        self._expected[address] = expected

    def blocks(self, address: str) -> int:
        return len(self._held.get(address, ()))

    def cached_tokens(self, addresses: Iterable[str], prompt_ids: Sequence[int]) -> dict[str, int]:
        """Per verifier, the prompt tokens whose KV its cache holds (its longest cached prefix of blocks)."""
        hashes_by_size: dict[int, list[int]] = {}
        cached = {}
        now = self.clock()
        for address in addresses:
            held, size = self._held.get(address), self._block_size.get(address)
            if held is None or size is None:
                cached[address] = 0
                continue
            if size not in hashes_by_size:
                hashes_by_size[size] = prompt_block_hashes(prompt_ids, size)
            expected = self._expected.get(address, {})
            blocks = 0
            for h in hashes_by_size[size]:
                if h not in held and expected.get(h, 0.0) <= now:
                    break
                blocks += 1
            cached[address] = blocks * size
        return cached
