"""ContextIndex: incremental appends give the same index as one bulk build, and its matches are exactly
the earlier occurrences of the text's ending, with their true match lengths (checked by brute force)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specedge.edge.context_index import ContextIndex


def brute_force_matches(tokens: list[int], max_len: int) -> dict[int, int]:
    """end position -> match length (>= 2) of every earlier occurrence of the text's ending."""
    n = len(tokens)
    out = {}
    for p in range(n - 1):
        m = 0
        while m < max_len and p - m >= 0 and tokens[p - m] == tokens[n - 1 - m]:
            m += 1
        if m >= 2:
            out[p] = m
    return out


def random_text(rng: random.Random, n: int, alphabet: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_incremental_appends_equal_one_bulk_build(seed):
    rng = random.Random(seed)
    tokens = random_text(rng, rng.randint(0, 400), alphabet=rng.choice([2, 5, 50]))
    bulk = ContextIndex(tokens)
    inc = ContextIndex(tokens[: rng.randint(0, len(tokens))])
    while len(inc) < len(tokens):
        k = rng.choice([1, 2, 3, 40])  # small appends one by one, large ones in bulk
        inc.append(tokens[len(inc) : len(inc) + k])
    n = len(tokens)
    assert inc.tokens[:n].tolist() == bulk.tokens[:n].tolist() == tokens
    assert inc.prev[:n].tolist() == bulk.prev[:n].tolist()
    assert inc.head == bulk.head


@pytest.mark.parametrize("seed", range(30))
def test_matches_are_every_earlier_occurrence_with_its_true_length(seed):
    rng = random.Random(100 + seed)
    tokens = random_text(rng, rng.randint(2, 300), alphabet=rng.choice([2, 3, 8]))
    index = ContextIndex(tokens[:10])
    index.append(tokens[10:])
    ends, lengths = index.matches(max_occurrences=10_000, max_len=12)
    want = brute_force_matches(tokens, max_len=12)
    assert dict(zip(ends.tolist(), lengths.tolist())) == want
    assert ends.tolist() == sorted(want, reverse=True)  # most recent first


def test_matches_are_capped_to_the_most_recent_occurrences():
    index = ContextIndex([1, 2] * 50)
    ends, lengths = index.matches(max_occurrences=5, max_len=8)
    assert ends.tolist() == [97, 95, 93, 91, 89]
    assert lengths.tolist() == [8] * 5


def test_continuations_never_pass_the_end_of_the_text():
    index = ContextIndex([7, 8, 9, 7, 8])
    ends, lengths = index.matches()
    assert ends.tolist() == [1] and lengths.tolist() == [2]
    assert index.continuation(1, depth=10).tolist() == [9, 7, 8]


def test_short_texts_have_no_matches():
    for tokens in ([], [1], [1, 1]):
        ends, _ = ContextIndex(tokens).matches()
        assert len(ends) == 0


def test_large_vocabulary_ids_do_not_collide():
    big = 262_143
    index = ContextIndex([big, 1, 5, 1, big])
    index.append([1])
    ends, lengths = index.matches()
    assert ends.tolist() == [1] and lengths.tolist() == [2]
    assert np.issubdtype(index.tokens.dtype, np.integer)
