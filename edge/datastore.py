"""Long-term datastore: a token corpus and the suffix array of its reversal, memory-mapped from disk.

Reading the corpus backwards turns "the longest suffix of my context that occurs in the corpus" into one
left-to-right search: each further context token, read from the end, narrows the suffix-array range of
occurrences, so the deepest non-empty range holds every occurrence of the longest match. The suffix array
is built in numpy (edge/suffix_array.py). Documents are separated by -1, which no continuation crosses.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specedge.edge.suffix_array import suffix_array

SEPARATOR = -1
FORMAT = 1
_VECTOR_RANGE = 1024  # narrow ranges up to this size with one vectorised search (bisect above it)
_FINISH_RANGE = 256  # at most this many suffixes left: settle every remaining level in one comparison
_SECOND_CACHE = 1 << 17  # memoised bigram ranges before the memo starts over


@dataclass(frozen=True)
class Match:
    length: int  # context tokens matched
    count: int  # occurrences in the corpus
    ends: np.ndarray  # corpus positions of the last matched token, a sample of at most `max_occurrences`


class Datastore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{self.path} is not a specedge datastore (no meta.json); build one with "
                                    "`specedge index build FILE... -o DIR`")
        self.meta = json.loads(meta_file.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.path}: datastore format {self.meta.get('format')} is not {FORMAT}; rebuild it")
        # Plain ndarray views of the memory maps: np.memmap's own indexing is several times slower.
        self.corpus = np.load(self.path / "corpus.npy", mmap_mode="r").view(np.ndarray)
        self.sa = np.load(self.path / "reversed_sa.npy", mmap_mode="r").view(np.ndarray)
        if len(self.corpus) != len(self.sa) or len(self.corpus) != self.meta["num_tokens"]:
            raise ValueError(f"{self.path}: corpus and suffix array sizes disagree; rebuild the datastore")
        self.n = len(self.corpus)
        # Where the suffixes starting with each token begin: the first narrowing step is a lookup.
        self.first_bounds = np.load(self.path / "first_bounds.npy")  # token + 1 -> start; SEPARATOR = -1 -> 0
        self._second: dict[tuple[int, int], tuple[int, int]] = {}  # (token 0, token 1) -> range, memoised

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.meta["tokenizer"]

    def longest_match(self, context: np.ndarray | list[int], max_len: int = 32, max_occurrences: int = 16,
                      min_len: int = 2) -> Match | None:
        """Occurrences of the longest suffix of `context` (at most `max_len` tokens) found in the corpus."""
        lo, hi, length = 0, self.n, 0
        pattern = np.asarray(context, dtype=np.int64)[::-1][:max_len]  # the context read backwards
        for j in range(len(pattern)):
            if hi - lo <= _FINISH_RANGE:  # few suffixes left: compare all remaining levels at once
                starts = np.asarray(self.sa[lo:hi], dtype=np.int64)
                rest = pattern[j:]
                ahead = self._reversed_token((starts[:, None] + j + np.arange(len(rest))[None, :]).ravel())
                agree = np.logical_and.accumulate(ahead.reshape(len(starts), -1) == rest[None, :], axis=1)
                extra = agree.sum(axis=1)
                best = int(extra.max())
                if best > 0:  # the longest suffixes sit together in suffix-array order
                    keep = np.flatnonzero(extra == best)
                    lo, hi, length = lo + int(keep[0]), lo + int(keep[-1]) + 1, j + best
                break
            if j == 0:
                lo2, hi2 = self._first(int(pattern[0]))
            elif j == 1:  # the widest range that needs a search: remember it, contexts repeat bigrams
                key = (int(pattern[0]), int(pattern[1]))
                if key not in self._second:
                    if len(self._second) > _SECOND_CACHE:
                        self._second.clear()
                    self._second[key] = self._narrow(lo, hi, 1, key[1])
                lo2, hi2 = self._second[key]
            else:
                lo2, hi2 = self._narrow(lo, hi, j, int(pattern[j]))
            if lo2 >= hi2:
                break
            lo, hi, length = lo2, hi2, j + 1
        if length < min_len:
            return None
        count = hi - lo
        picks = _spread(lo, hi - 1, min(count, max_occurrences))
        ends = self.n - 1 - np.asarray(self.sa[picks], dtype=np.int64)
        return Match(length, count, ends)

    def continuations(self, ends: np.ndarray, depth: int) -> np.ndarray:
        """[len(ends), depth]: the tokens after each end, padded with -1 from a document separator on."""
        at = ends[:, None] + 1 + np.arange(depth)[None, :]
        tokens = np.asarray(self.corpus[np.minimum(at, self.n - 1)], dtype=np.int64)
        tokens[at >= self.n] = SEPARATOR
        stopped = np.logical_or.accumulate(tokens == SEPARATOR, axis=1)  # SEPARATOR is -1: the padding
        return np.where(stopped, -1, tokens)

    def _reversed_token(self, i: np.ndarray | int):
        """Token i of the reversed corpus; -2 past its end (sorts before every token and the separator)."""
        if isinstance(i, np.ndarray):
            if len(i) and i.max() < self.n:  # nearly always: fewer numpy calls
                return self.corpus[self.n - 1 - i]
            out = np.full(len(i), -2, dtype=np.int64)
            inside = i < self.n
            out[inside] = self.corpus[self.n - 1 - i[inside]]
            return out
        return int(self.corpus[self.n - 1 - i]) if i < self.n else -2

    def _first(self, token: int) -> tuple[int, int]:
        if not -1 <= token < len(self.first_bounds) - 2:
            return 0, 0
        return int(self.first_bounds[token + 1]), int(self.first_bounds[token + 2])

    def _narrow(self, lo: int, hi: int, j: int, token: int) -> tuple[int, int]:
        """The sub-range of suffixes in [lo, hi) (all sharing j tokens) whose token j equals `token`."""
        if hi - lo <= _VECTOR_RANGE:
            column = self._reversed_token(np.asarray(self.sa[lo:hi], dtype=np.int64) + j)
            return lo + int(np.searchsorted(column, token, "left")), lo + int(np.searchsorted(column, token, "right"))
        key = _Column(self, j)
        return bisect.bisect_left(key, token, lo, hi), bisect.bisect_right(key, token, lo, hi)


def _spread(first: int, last: int, num: int) -> np.ndarray:
    """`np.linspace(first, last, num).round()` as integers, without linspace's cost (a draft's hot path)."""
    if num == 1:
        return np.array([first], dtype=np.int64)
    picks = np.rint(np.arange(num) * ((last - first) / (num - 1)) + first).astype(np.int64)
    picks[-1] = last
    return picks


class _Column:
    """Token j of every suffix, in suffix-array order, as a lazy sequence for `bisect`."""

    def __init__(self, store: Datastore, j: int) -> None:
        self.store, self.j = store, j

    def __getitem__(self, k: int) -> int:
        return self.store._reversed_token(int(self.store.sa[k]) + self.j)

    def __len__(self) -> int:
        return self.store.n


def build(
    documents: Iterable[list[int]],
    out: Path,
    tokenizer_fingerprint: str,
    sources: list[str],
    progress: Callable[[str], None] = lambda msg: None,
) -> dict:
    """Write a datastore of the given token documents to `out`; returns its metadata."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # until rewritten, the directory is not a datastore
    parts: list[np.ndarray] = []
    num_docs = 0
    for doc in documents:
        if len(doc):
            parts += [np.asarray(doc, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
            num_docs += 1
    corpus = np.concatenate(parts) if parts else np.array([SEPARATOR], dtype=np.int32)
    progress(f"{len(corpus):,} tokens from {num_docs} documents; sorting suffixes")
    t_sort = time.perf_counter()
    sa = suffix_array(corpus[::-1])
    sort_s = time.perf_counter() - t_sort
    np.save(out / "corpus.npy", corpus)
    np.save(out / "reversed_sa.npy", sa.astype(np.int32 if len(corpus) < 2**31 else np.int64))
    first = corpus[::-1][sa]  # each suffix's first token, in suffix-array order (sorted)
    np.save(out / "first_bounds.npy", np.searchsorted(first, np.arange(-1, int(corpus.max()) + 2)).astype(np.int64))
    meta = {
        "format": FORMAT, "num_tokens": int(len(corpus)), "num_documents": num_docs,
        "tokenizer": tokenizer_fingerprint, "sources": sources,
        "build_s": round(time.perf_counter() - start, 3), "suffix_sort_s": round(sort_s, 3),
        "bytes_per_token": round(sum(f.stat().st_size for f in out.glob("*.npy")) / len(corpus), 3),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: its presence means complete
    return meta
