"""Short-term index over the prompt and the generated text: where did the text's current ending occur before?

Hash chains over the bigrams of the text (the scheme zlib uses to find earlier matches): `head` maps a
bigram to its latest end position, `prev[i]` links position i to the previous end of the same bigram.
Appending a token is O(1); indexing a long prompt is one vectorised sort. A query walks the chain of the
text's last bigram (most recent occurrences first) and measures each occurrence's full match length
backwards in one vectorised comparison.
"""

from __future__ import annotations

import numpy as np

KEY = 2  # tokens per chain key: the shortest match the index can report


class ContextIndex:
    def __init__(self, tokens: list[int] | np.ndarray = ()) -> None:
        self.tokens = np.zeros(max(1024, 2 * len(tokens)), dtype=np.int64)
        self.prev = np.full(len(self.tokens), -1, dtype=np.int64)
        self.head: dict[int, int] = {}
        self.n = 0
        self._bulk_append(np.asarray(tokens, dtype=np.int64))

    def __len__(self) -> int:
        return self.n

    def append(self, tokens: list[int]) -> None:
        if len(tokens) > 16:
            self._bulk_append(np.asarray(tokens, dtype=np.int64))
            return
        self._reserve(self.n + len(tokens))
        for t in tokens:
            i = self.n
            self.tokens[i] = t
            self.n += 1
            if i >= KEY - 1:
                key = self._key_at(i)
                self.prev[i] = self.head.get(key, -1)
                self.head[key] = i

    def matches(self, max_occurrences: int = 32, max_len: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """Earlier occurrences of the text's ending: (end positions, match lengths), most recent first.

        An occurrence ending at position p matches the last m tokens of the text: tokens[p - m + 1 : p + 1]
        equals tokens[n - m : n], with m >= KEY, capped at `max_len`. Only p < n - 1 are returned, so every
        occurrence has at least one token after it.
        """
        last = self.n - 1
        if last < KEY:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        ends = []
        p = self.prev[last]
        while p >= 0 and len(ends) < max_occurrences:
            ends.append(p)
            p = self.prev[p]
        ends = np.asarray(ends, dtype=np.int64)
        if len(ends) == 0:
            return ends, ends
        # Compare backwards: offsets 0..L-1 before each end against the same offsets before `last`.
        depth = min(max_len, last + 1)
        offsets = np.arange(depth)
        before = ends[:, None] - offsets[None, :]
        valid = before >= 0
        same = valid & (self.tokens[np.where(valid, before, 0)] == self.tokens[last - offsets][None, :])
        lengths = np.where(same.all(axis=1), depth, np.argmin(same, axis=1))
        keep = lengths >= KEY  # a bigram hash chain can only link equal bigrams, but be safe
        return ends[keep], lengths[keep]

    def continuation(self, end: int, depth: int) -> np.ndarray:
        """The tokens after position `end` (at most `depth`, never past the text's end)."""
        return self.tokens[end + 1 : min(end + 1 + depth, self.n)]

    # ---- internals -------------------------------------------------------------------------------

    def _key_at(self, i: int) -> int:
        return int(self.tokens[i - 1]) << 32 | int(self.tokens[i])

    def _reserve(self, size: int) -> None:
        if size <= len(self.tokens):
            return
        capacity = max(size, 2 * len(self.tokens))
        self.tokens = np.concatenate([self.tokens, np.zeros(capacity - len(self.tokens), dtype=np.int64)])
        self.prev = np.concatenate([self.prev, np.full(capacity - len(self.prev), -1, dtype=np.int64)])

    def _bulk_append(self, new: np.ndarray) -> None:
        """Append many tokens at once: chain every new bigram with one stable sort."""
        if len(new) == 0:
            return
        start = self.n
        self._reserve(start + len(new))
        self.tokens[start : start + len(new)] = new
        self.n += len(new)
        first = max(start, KEY - 1)
        if first >= self.n:
            return
        ends = np.arange(first, self.n)
        keys = self.tokens[ends - 1] << 32 | self.tokens[ends]
        order = np.argsort(keys, kind="stable")
        sorted_keys, sorted_ends = keys[order], ends[order]
        same_as_before = np.empty(len(order), dtype=bool)
        same_as_before[0] = False
        same_as_before[1:] = sorted_keys[1:] == sorted_keys[:-1]
        # Within a run of equal keys, each end's predecessor is the previous end in the run; the first
        # end of a run links to the key's head from before this append.
        self.prev[sorted_ends[1:][same_as_before[1:]]] = sorted_ends[:-1][same_as_before[1:]]
        run_starts = np.flatnonzero(~same_as_before)
        run_ends = np.append(run_starts[1:], len(order)) - 1
        head = self.head
        for k, s, e in zip(sorted_keys[run_starts].tolist(), sorted_ends[run_starts].tolist(),
                           sorted_ends[run_ends].tolist()):
            self.prev[s] = head.get(k, -1)
            head[k] = e
