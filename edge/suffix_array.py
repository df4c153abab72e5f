"""Suffix arrays of token sequences, in numpy: prefix doubling that re-sorts only unsettled suffixes.

After a first sort by the first few tokens, each round sorts the suffixes that still share their first h
tokens with another one by the rank of what follows those h tokens, so h doubles per round; a suffix
whose group has become a singleton is settled and drops out (Larsson and Sadakane's refinement).
Natural text settles most suffixes within a few rounds, so the rounds after those are small; only long
repeats keep suffixes in play, for log2(repeat length) rounds. Measured here on one core, for the 10M
tokens of bench/drafting_bench.py (Spec-Bench sentences reshuffled into documents: many repeats): ~7 s,
where libdivsufsort takes ~1.2 s; the whole datastore builds in ~17 s. The only packaging of libdivsufsort
for integer alphabets (`pydivsufsort`) installs
12 MB: more than everything else the edge needs beyond numpy and grpcio (BENCHMARKS.md, "Edge start-up").
"""

from __future__ import annotations

import numpy as np


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The start positions of the suffixes of `tokens` (integers) in lexicographic order, a suffix that is
    a prefix of another first. int32 below 2**31 tokens, else int64."""
    n = len(tokens)
    tokens = np.asarray(tokens, dtype=np.int64)
    index = np.int32 if n < 2**31 else np.int64  # positions and ranks: half the memory of int64 when they fit
    if n == 0:
        return np.zeros(0, dtype=index)
    if n >= 3 << 30:  # ranks are combined as first * (n + 1) + second in an int64
        raise ValueError(f"{n:,} tokens: suffix arrays are built for fewer than 3 billion")
    # The first sort is by the first `h` tokens at once, packed into one int64 (0 past the end): the rounds
    # that would get there by doubling from 1 are the largest ones.
    low = int(tokens.min())
    base = int(tokens.max()) - low + 2
    h = max(1, int(62 // np.log2(base)))
    first = np.zeros(n, dtype=np.int64)
    for k in range(min(h, n)):
        first[: n - k] += (tokens[k:] - (low - 1)) * base ** (h - 1 - k)
    sa = np.argsort(first).astype(index)
    first = first[sa]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]]).astype(index)  # where groups begin in `sa`
    sizes = np.diff(np.r_[starts, n])
    rank = np.empty(n, dtype=index)  # a suffix's rank: where its group begins in `sa`
    rank[sa] = np.repeat(starts, sizes)
    while True:
        unsettled = sizes > 1
        if not unsettled.any():
            return sa
        starts, sizes = starts[unsettled], sizes[unsettled]
        offsets = np.cumsum(sizes) - sizes
        at = np.repeat(starts - offsets, sizes) + np.arange(int(sizes.sum()), dtype=index)  # places in `sa`
        pos = sa[at]
        ahead = pos + h
        after = np.where(ahead < n, rank[np.minimum(ahead, n - 1)], -1)  # past the end sorts first
        key = rank[pos].astype(np.int64) * (n + 1) + (after + 1)  # a group's members stay in its places
        order = np.argsort(key)
        pos, key = pos[order], key[order]
        sa[at] = pos
        begins = np.r_[True, key[1:] != key[:-1]]
        starts = at[begins]
        rank[pos] = starts[np.cumsum(begins) - 1]
        sizes = np.diff(np.r_[np.flatnonzero(begins), len(pos)])
        h *= 2
