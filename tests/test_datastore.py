"""Long-term datastore: its suffix arrays and the longest match of a context's ending with all its
occurrences, checked by brute force on random token strings; continuations stop at document boundaries;
bad stores are refused."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.edge import datastore
from specedge.edge.datastore import Datastore
from specedge.edge.suffix_array import suffix_array


def brute_force(docs: list[list[int]], context: list[int], max_len: int) -> tuple[int, set[tuple[int, int]]]:
    """(longest match length, {(doc, end index)} of its occurrences) of context's suffixes in docs."""
    best, where = 0, set()
    for m in range(1, min(max_len, len(context)) + 1):
        pattern = context[-m:]
        found = {(d, i + m - 1) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1)
                 if doc[i : i + m] == pattern}
        if not found:
            break
        best, where = m, found
    return best, where


def corpus_positions(docs: list[list[int]]) -> dict[int, tuple[int, int]]:
    """corpus position -> (doc, index in doc), for the layout doc0 SEP doc1 SEP ..."""
    out, pos = {}, 0
    for d, doc in enumerate(docs):
        for i in range(len(doc)):
            out[pos + i] = (d, i)
        pos += len(doc) + 1
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(-1, 3), max_size=80) | st.lists(st.sampled_from([-1, 7, 262_143]), max_size=80),
       st.integers(1, 6))
def test_the_suffix_array_orders_suffixes_as_sorting_them_does(tokens, repeats):
    """Few distinct tokens and repeated runs: long shared prefixes, many doubling rounds."""
    tokens = (tokens * repeats)[:300]
    got = suffix_array(np.array(tokens, dtype=np.int32))
    assert got.tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])
    assert got.dtype == np.int32


def test_the_suffix_array_of_a_long_repetitive_text_is_sorted():
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50_000, size=2_000)
    tokens = np.concatenate([block, rng.integers(0, 5, size=3_000), block, block[:700], [-1], block])
    sa = suffix_array(tokens)
    assert sorted(sa.tolist()) == list(range(len(tokens)))
    for a, b in itertools.pairwise(sa.tolist()):  # each neighbour pair in order: first difference, or a is a prefix
        n = min(len(tokens) - a, len(tokens) - b)
        differ = np.flatnonzero(tokens[a:a + n] != tokens[b:b + n])
        assert tokens[a + differ[0]] < tokens[b + differ[0]] if len(differ) else len(tokens) - a < len(tokens) - b


@pytest.mark.parametrize("seed", range(25))
def test_longest_match_finds_every_occurrence_of_the_longest_matching_suffix(tmp_path, seed):
    rng = random.Random(seed)
    alphabet = rng.choice([2, 3, 6, 30])
    docs = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 300))] for _ in range(rng.randint(1, 5))]
    datastore.build(docs, tmp_path, "fp", ["test"])
    store = Datastore(tmp_path)
    positions = corpus_positions(docs)
    for _ in range(20):
        context = [rng.randrange(alphabet) for _ in range(rng.randint(1, 12))]
        want_len, want_where = brute_force(docs, context, max_len=8)
        match = store.longest_match(context, max_len=8, max_occurrences=10**6, min_len=1)
        if want_len == 0:
            assert match is None
            continue
        assert match.length == want_len and match.count == len(want_where)
        assert {positions[int(e)] for e in match.ends} == want_where


def test_occurrences_are_sampled_but_counted_in_full(tmp_path):
    datastore.build([[1, 2, 3] * 100], tmp_path, "fp", ["test"])
    match = Datastore(tmp_path).longest_match([9, 1, 2], max_len=8, max_occurrences=7)
    assert match.length == 2 and match.count == 100 and len(match.ends) == 7


def test_continuations_stop_at_the_end_of_their_document(tmp_path):
    datastore.build([[5, 6, 7, 8], [5, 6, 9]], tmp_path, "fp", ["a", "b"])
    store = Datastore(tmp_path)
    match = store.longest_match([4, 5, 6], max_occurrences=10)
    assert match.length == 2 and match.count == 2
    assert sorted(store.continuations(match.ends, 4).tolist()) == [[7, 8, -1, -1], [9, -1, -1, -1]]


def test_metadata_reports_size_and_build_time(tmp_path):
    meta = datastore.build([list(range(5000)), [4]], tmp_path, "abc", ["x", "y"])
    assert meta["num_tokens"] == 5003 and meta["num_documents"] == 2 and meta["tokenizer"] == "abc"
    assert meta["build_s"] >= 0
    # int32 corpus + int32 suffix array, plus one int64 per vocabulary entry (+ file headers)
    assert 16 <= meta["bytes_per_token"] < 16.2
    assert json.loads((tmp_path / "meta.json").read_text()) == meta


def test_a_directory_without_metadata_or_with_inconsistent_files_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a specedge datastore"):
        Datastore(tmp_path)
    datastore.build([[1, 2, 3]], tmp_path, "fp", ["x"])
    np.save(tmp_path / "reversed_sa.npy", np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match="rebuild"):
        Datastore(tmp_path)
