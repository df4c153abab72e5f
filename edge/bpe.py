"""Byte-pair encoding as the `tokenizers` library runs a `tokenizer.json`'s BPE model, in plain Python.

A word starts as one symbol per character (a `<0xNN>` token per byte where the character is not in the
vocabulary and the model falls back to bytes, else the unknown token); then, while any adjacent pair has a
merge, the pair of lowest rank (leftmost on ties) becomes one symbol. A heap of candidate merges keeps that
O(n log n) in the word's length, which matters for SentencePiece-style vocabularies (Gemma 3): there
the whole text between added tokens is one word.

Such a word is cut before each run of `▁` (the vocabulary's space) where no token spans the cut: a merge
only makes a token of the vocabulary, so none can cross a boundary that no token contains, and the parts
encode exactly as the whole. Gemma 3 has one token with `▁` after another character (`>▁</`), so `>` is
never cut after. The parts are short and repeat, so they are cached.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from heapq import heapify, heappop, heappush

import numpy as np

from specedge.edge.merge_table import MergeTable

SPACE = "\u2581"  # SentencePiece's visible space
CACHE_WORDS = 100_000
CACHE_WORD_CHARS = 256


class BpeModel:
    def __init__(self, tokens: list[str | None], merges: MergeTable, unk_token: str | None = None,
                 byte_fallback: bool = False, fuse_unk: bool = False, continuing_subword_prefix: str = "",
                 end_of_word_suffix: str = "", ignore_merges: bool = False) -> None:
        """`tokens`: each id's string (None where an id has none); `merges`: left * len(tokens) + right ->
        rank * len(tokens) + merged id."""
        self.tokens = tokens
        self.merges = merges
        self.size = len(tokens)
        self.byte_fallback = byte_fallback
        self.fuse_unk = fuse_unk
        self.prefix = continuing_subword_prefix or ""
        self.suffix = end_of_word_suffix or ""
        self.ignore_merges = ignore_merges
        affixed = bool(self.prefix or self.suffix)
        if ignore_merges or affixed:  # whole words, or characters with their affixes: any token
            self._symbols = {t: i for i, t in enumerate(tokens) if t is not None}
        else:  # single characters, byte tokens and the unknown token start a word
            byte_token = re.compile(r"<0x[0-9A-F]{2}>")
            self._symbols = {t: i for i, t in enumerate(tokens) if t is not None and (
                len(t) == 1 or t == unk_token or (len(t) == 6 and byte_token.fullmatch(t)))}
        self.unk_id = None if unk_token is None else self._symbols.get(unk_token)
        if unk_token is not None and self.unk_id is None:
            raise ValueError(f"the BPE model's unknown token {unk_token!r} is not in its vocabulary")
        self._cuts = self._space_cuts() if not affixed else None
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_json(cls, spec: dict) -> BpeModel:
        if spec.get("type") != "BPE":
            raise ValueError(f"the edge's tokenizer implements BPE models only, not {spec.get('type')!r}")
        if spec.get("dropout"):
            raise ValueError("BPE dropout is random; the edge's tokenizer encodes deterministically only")
        vocab: dict[str, int] = spec["vocab"]
        tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            tokens[i] = token
        prefix = spec.get("continuing_subword_prefix") or ""
        rows = []
        for merge in spec["merges"]:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            try:
                rows.append((vocab[left], vocab[right], vocab[left + right[len(prefix):]]))
            except KeyError as e:
                raise ValueError(f"BPE merge {left!r} + {right!r} names a token outside the vocabulary") from e
        merges = MergeTable.build(np.array(rows, dtype=np.int64).reshape(-1, 3), len(tokens))
        return cls(tokens, merges, **options_of(spec))

    def encode(self, word: str) -> Sequence[int]:
        """The ids of one pre-tokenized word (shared with a cache: do not modify)."""
        if self._cuts is not None and SPACE in word[1:]:
            return [i for part in self._parts(word) for i in self._cached(part)]
        return self._cached(word)

    def _cached(self, word: str) -> Sequence[int]:
        ids = self._cache.get(word)
        if ids is None:
            ids = tuple(self._encode(word))
            if len(word) <= CACHE_WORD_CHARS:
                if len(self._cache) >= CACHE_WORDS:
                    self._cache.clear()
                self._cache[word] = ids
        return ids

    def forget_words(self) -> None:
        self._cache.clear()

    def _encode(self, word: str) -> list[int]:
        if self.ignore_merges and (whole := self._symbols.get(word)) is not None:
            return [whole]
        return self._merge(self._initial_symbols(word))

    def _initial_symbols(self, word: str) -> list[int]:
        """One id per character (the library's `merge_word` before merging), bytes or unknown where needed."""
        ids: list[int] = []
        unk: list[int] | None = None  # a pending unknown symbol, fused with the next unknown ones if asked
        last = len(word) - 1
        for n, char in enumerate(word):
            s = (self.prefix if n and self.prefix else "") + char + (self.suffix if n == last else "")
            i = self._symbols.get(s)
            if i is not None:
                if unk is not None:
                    ids += unk
                    unk = None
                ids.append(i)
                continue
            if self.byte_fallback:
                fallback = [self._symbols.get(f"<0x{b:02X}>") for b in s.encode("utf-8")]
                if None not in fallback:
                    ids += fallback
                    continue
            if self.unk_id is not None:
                if unk is not None and not self.fuse_unk:
                    ids += unk
                    unk = None
                unk = unk or [self.unk_id]
        if unk is not None:
            ids += unk
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        n = len(ids)
        if n < 2:
            return ids
        get, size = self.merges.get, self.size
        after = list(range(1, n + 1))
        after[-1] = -1
        before = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for pos in range(n - 1):
            m = get(ids[pos] * size + ids[pos + 1])
            if m >= 0:
                heap.append((m // size, pos, m % size))  # (rank, position, merged id): lowest rank, leftmost
        heapify(heap)
        while heap:
            _, pos, merged = heappop(heap)
            right = after[pos]
            if not alive[pos] or right < 0:
                continue
            m = get(ids[pos] * size + ids[right])
            if m < 0 or m % size != merged:  # this pair changed since the entry was pushed
                continue
            ids[pos] = merged
            alive[right] = False
            nxt = after[right]
            after[pos] = nxt
            if nxt >= 0:
                before[nxt] = pos
                m = get(merged * size + ids[nxt])
                if m >= 0:
                    heappush(heap, (m // size, pos, m % size))
            prev = before[pos]
            if prev >= 0:
                m = get(ids[prev] * size + merged)
                if m >= 0:
                    heappush(heap, (m // size, prev, m % size))
        return [ids[pos] for pos in range(n) if alive[pos]]

    # --- cutting long words where no merge can cross -------------------------------------------------
    def _space_cuts(self) -> re.Pattern | None:
        """Where a word may be cut: before a run of SPACE that follows a character that is a symbol itself
        and that no token has right before a SPACE."""
        if SPACE not in self._symbols:
            return None
        glued = {t[i - 1] for t in self.tokens if t and SPACE in t[1:]
                 for i in range(1, len(t)) if t[i] == SPACE and t[i - 1] != SPACE}
        glued.add(SPACE)
        return re.compile(f"(?<=[^{re.escape(''.join(sorted(glued)))}])(?={SPACE})")

    def _parts(self, word: str) -> list[str]:
        parts = self._cuts.split(word)
        out = [parts[0]]
        for part in parts[1:]:
            if out[-1][-1] in self._symbols:
                out.append(part)
            else:  # spelled by bytes or unknown: its symbol's string is not the character, keep it whole
                out[-1] += part
        return out


def options_of(spec: dict) -> dict:
    """The keyword options of BpeModel from a tokenizer.json model spec."""
    return {"unk_token": spec.get("unk_token"), "byte_fallback": bool(spec.get("byte_fallback")),
            "fuse_unk": bool(spec.get("fuse_unk")), "continuing_subword_prefix": spec.get("continuing_subword_prefix"),
            "end_of_word_suffix": spec.get("end_of_word_suffix"), "ignore_merges": bool(spec.get("ignore_merges"))}
