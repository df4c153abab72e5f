"""ContextIndex: incremental appends give the same index as one bulk build, and its matches are exactly
the earlier occurrences of the text's ending, with their true match lengths (checked by brute force)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specedge.edge.context_index import ContextIndex


def brute_force_matches(tokens: list[int], max_len: int, min_len: int = 1) -> dict[int, int]:
    """end position -> match length (>= min_len) of every earlier occurrence of the text's ending."""
    n = len(tokens)
    out = {}
    for p in range(n - 1):
        m = 0
        while m < max_len and p - m >= 0 and tokens[p - m] == tokens[n - 1 - m]:
            m += 1
        if m >= min_len:
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
    for k in (1, 2):
        assert inc.prev[k][:n].tolist() == bulk.prev[k][:n].tolist()
    assert inc.head == bulk.head


@pytest.mark.parametrize("seed", range(30))
def test_matches_are_every_earlier_occurrence_with_its_true_length(seed):
    rng = random.Random(100 + seed)
    tokens = random_text(rng, rng.randint(2, 300), alphabet=rng.choice([2, 3, 8]))
    index = ContextIndex(tokens[:10])
    index.append(tokens[10:])
    for min_len in (1, 2):
        ends, lengths = index.matches(max_occurrences=10_000, max_len=12, min_len=min_len)
        want = brute_force_matches(tokens, max_len=12, min_len=min_len)
        assert dict(zip(ends.tolist(), lengths.tolist())) == want
        longer = [p for p in ends.tolist() if want[p] >= 2]
        assert longer == sorted(longer, reverse=True)  # the bigram chain's finds, most recent first
        assert ends.tolist()[: len(longer)] == longer  # come before the unigram chain's


def test_matches_are_capped_to_the_most_recent_occurrences():
    index = ContextIndex([1, 2] * 50 + [3])
    index.append([1, 2])
    ends, lengths = index.matches(max_occurrences=5, max_len=8)
    assert ends.tolist()[:5] == [99, 97, 95, 93, 91]  # the bigram (1, 2): match length 2, then 3 before
    assert lengths.tolist()[:5] == [2] * 5
    assert ends.tolist()[5:] == [89, 87, 85, 83, 81]  # up to 5 more, new ones, from the unigram chain


def test_continuations_never_pass_the_end_of_the_text():
    index = ContextIndex([7, 8, 9, 7, 8])
    ends, lengths = index.matches(min_len=2)
    assert ends.tolist() == [1] and lengths.tolist() == [2]
    assert index.continuations(ends, depth=5).tolist() == [[9, 7, 8, -1, -1]]


def test_short_texts_have_no_matches():
    for tokens in ([], [1], [1, 2]):
        ends, _ = ContextIndex(tokens).matches()
        assert len(ends) == 0
    assert ContextIndex([1, 1]).matches()[0].tolist() == [0]  # a unigram match


def test_large_vocabulary_ids_do_not_collide():
    big = 262_143
    index = ContextIndex([big, 1, 5, 1, big])
    index.append([1])
    ends, lengths = index.matches(min_len=2)
    assert ends.tolist() == [1] and lengths.tolist() == [2]
    assert np.issubdtype(index.tokens.dtype, np.integer)


@pytest.mark.parametrize("seed", range(20))
def test_find_locates_another_texts_ending_like_brute_force(seed):
    rng = random.Random(300 + seed)
    alphabet = rng.choice([2, 3, 8])
    text = random_text(rng, rng.randint(1, 200), alphabet)
    query = random_text(rng, rng.randint(1, 20), alphabet)
    ends, lengths = ContextIndex(text).find(np.asarray(query), max_occurrences=10_000, max_len=12)
    # The occurrences in `text` of the query's ending are the matches of text + query's ending that lie
    # inside `text` (each with a token after it), measured without running into the query itself.
    want = {p: m for p, m in brute_force_matches(text + query, max_len=12).items() if p < len(text) - 1}
    want = {p: min(m, p + 1, len(query)) for p, m in want.items()}
    assert dict(zip(ends.tolist(), lengths.tolist())) == want


def test_continuations_stop_at_a_separator_between_texts():
    index = ContextIndex([5, 6, 7, -1, 5, 6, 8, 9, -1])
    ends, lengths = index.find(np.asarray([1, 5, 6]), min_len=2)
    assert sorted(ends.tolist()) == [1, 5] and lengths.tolist() == [2, 2]
    assert index.continuations(np.asarray([1, 5]), depth=4).tolist() == [[7, -1, -1, -1], [8, 9, -1, -1]]
