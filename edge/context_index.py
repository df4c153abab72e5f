"""Short-term index over the prompt and the generated text: where did the text's current ending occur before?

Hash chains (the scheme zlib uses to find earlier matches), one set keyed by the last token and one by
the last two: `head[k]` maps a key to its latest end position, `prev[k][i]` links position i to the
previous end of the same key. Appending a token is O(1); indexing a long prompt is one vectorised sort
per key size. A query walks the bigram chain (selective, finds long matches far back), then the unigram
chain for more candidates (a copy often starts right after a token the model produced fresh), and
measures every occurrence's full match length backwards in one vectorised comparison.
"""

from __future__ import annotations

import numpy as np

KEYS = (1, 2)  # tokens per chain key


class ContextIndex:
    def __init__(self, tokens: list[int] | np.ndarray = ()) -> None:
        capacity = max(1024, 2 * len(tokens))
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.prev = {k: np.full(capacity, -1, dtype=np.int64) for k in KEYS}
        self.head: dict[int, dict[int, int]] = {k: {} for k in KEYS}
        self.n = 0
        self._bulk_append(np.asarray(tokens, dtype=np.int64))

    def __len__(self) -> int:
        return self.n

    def append(self, tokens: list[int]) -> None:
        if len(tokens) > 256:  # a verifier's answer (a few tokens) is cheaper one by one than sorted
            self._bulk_append(np.asarray(tokens, dtype=np.int64))
            return
        self._reserve(self.n + len(tokens))
        for t in tokens:
            i = self.n
            self.tokens[i] = t
            self.n += 1
            for k in KEYS:
                if i >= k - 1:
                    key = self._key_at(i, k)
                    self.prev[k][i] = self.head[k].get(key, -1)
                    self.head[k][key] = i

    def matches(self, max_occurrences: int = 32, max_len: int = 64, min_len: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
        """Earlier occurrences of the text's ending: (end positions, match lengths).

        An occurrence ending at position p matches the last m tokens of the text: tokens[p - m + 1 : p + 1]
        equals tokens[n - m : n], with m >= `min_len`, capped at `max_len`. Only p < n - 1 are returned, so
        every occurrence has at least one token after it. At most `max_occurrences` from each chain, most
        recent first: those of the bigram chain (m >= 2), then further ones of the unigram chain (m = 1).
        """
        last = self.n - 1
        if last < 1:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        starts = {k: int(self.prev[k][last]) if last >= k - 1 else -1 for k in KEYS}
        return self._occurrences(starts, self.tokens[: self.n], max_occurrences, max_len, min_len)

    def find(self, query: np.ndarray, max_occurrences: int = 32, max_len: int = 64, min_len: int = 1
             ) -> tuple[np.ndarray, np.ndarray]:
        """Occurrences in this text of the ending of another one, `query`: as `matches`, for any text."""
        if len(query) == 0 or self.n == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        starts = {1: self.head[1].get(int(query[-1]), -1),
                  2: self.head[2].get(int(query[-2]) << 32 | int(query[-1]), -1) if len(query) > 1 else -1}
        return self._occurrences(starts, np.asarray(query, dtype=np.int64), max_occurrences, max_len, min_len)

    def _occurrences(self, starts: dict[int, int], query: np.ndarray, max_occurrences: int, max_len: int,
                     min_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Walk each chain from its start (bigram chain first), then measure every find's match with the
        ending of `query` backwards in one vectorised comparison."""
        ends: list[int] = []
        seen: set[int] = set()
        for k in sorted(KEYS, reverse=True):
            if k < min_len:
                break
            p, taken, steps, prev = starts[k], 0, 0, self.prev[k]
            while p >= 0 and taken < max_occurrences and steps < 4 * max_occurrences:
                if p not in seen and p < self.n - 1:  # the bigram chain's finds are on the unigram chain too
                    ends.append(p)
                    seen.add(p)
                    taken += 1
                p, steps = prev.item(p), steps + 1  # (a Python int: numpy's scalars are slower to hash)
        ends = np.asarray(ends, dtype=np.int64)
        if len(ends) == 0:
            return ends, ends
        # Compare backwards: offsets 0..L-1 before each end against the same offsets before the query's end.
        depth = min(max_len, len(query))
        offsets = np.arange(depth)
        before = ends[:, None] - offsets[None, :]
        if ends.min() >= depth - 1:  # nearly always: every offset inside the text, fewer numpy calls
            same = self.tokens[before] == query[len(query) - 1 - offsets][None, :]
        else:
            valid = before >= 0
            same = valid & (self.tokens[np.where(valid, before, 0)] == query[len(query) - 1 - offsets][None, :])
        lengths = np.where(same.all(axis=1), depth, np.argmin(same, axis=1))
        keep = lengths >= min_len
        return ends[keep], lengths[keep]

    def continuations(self, ends: np.ndarray, depth: int) -> np.ndarray:
        """[len(ends), depth]: the tokens after each end, padded with -1 past the text's end or a -1 in it
        (the separator between texts, which no continuation crosses)."""
        at = ends[:, None] + 1 + np.arange(depth)[None, :]
        out = np.where(at < self.n, self.tokens[np.minimum(at, self.n - 1)], -1)
        return np.where(np.logical_and.accumulate(out >= 0, axis=1), out, -1)

    # ---- internals -------------------------------------------------------------------------------

    def _key_at(self, i: int, k: int) -> int:
        return int(self.tokens[i]) if k == 1 else int(self.tokens[i - 1]) << 32 | int(self.tokens[i])

    def _reserve(self, size: int) -> None:
        if size <= len(self.tokens):
            return
        capacity = max(size, 2 * len(self.tokens))
        grow = capacity - len(self.tokens)
        self.tokens = np.concatenate([self.tokens, np.zeros(grow, dtype=np.int64)])
        for k in KEYS:
            self.prev[k] = np.concatenate([self.prev[k], np.full(grow, -1, dtype=np.int64)])

    def _bulk_append(self, new: np.ndarray) -> None:
        """Append many tokens at once: chain every new key with one stable sort per key size."""
        if len(new) == 0:
            return
        start = self.n
        self._reserve(start + len(new))
        self.tokens[start : start + len(new)] = new
        self.n += len(new)
        for k in KEYS:
            first = max(start, k - 1)
            if first < self.n:
                ends = np.arange(first, self.n)
                keys = self.tokens[ends] if k == 1 else self.tokens[ends - 1] << 32 | self.tokens[ends]
                self._chain(k, keys, ends)

    def _chain(self, k: int, keys: np.ndarray, ends: np.ndarray) -> None:
        prev, head = self.prev[k], self.head[k]
        order = np.argsort(keys, kind="stable")
        sorted_keys, sorted_ends = keys[order], ends[order]
        same_as_before = np.empty(len(order), dtype=bool)
        same_as_before[0] = False
        same_as_before[1:] = sorted_keys[1:] == sorted_keys[:-1]
        # Within a run of equal keys, each end's predecessor is the previous end in the run; the first
        # end of a run links to the key's head from before this append.
        prev[sorted_ends[1:][same_as_before[1:]]] = sorted_ends[:-1][same_as_before[1:]]
        run_starts = np.flatnonzero(~same_as_before)
        run_ends = np.append(run_starts[1:], len(order)) - 1
        for key, s, e in zip(sorted_keys[run_starts].tolist(), sorted_ends[run_starts].tolist(),
                             sorted_ends[run_ends].tolist()):
            prev[s] = head.get(key, -1)
            head[key] = e
