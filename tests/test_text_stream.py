"""Streamed text: pieces released as tokens arrive never need taking back, and joined they are the final
text (cut before the first stop string). Both served tokenizers: SmolLM2's byte-level BPE (a character's
bytes span tokens) and Gemma 3's SentencePiece BPE with byte fallback (`<0xNN>` tokens)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specedge.cloud.model_registry import resolve_model_dir
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.edge.text_stream import TextStream, cut_at_stops
from specedge.edge.tokenizer import EdgeTokenizer

TEXTS = ["Hello world, this is a test.", "ünïcödé 日本語 한국어 🙂🚀 done", "  spaces\tand\n\nnew lines ",
         "Count: 1, 2, 3, 4, 5, 6, 7", "def f(x):\n    return {'a': [1, 2]}\n", "emoji 👩‍👩‍👧 family"]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def tokenizer(request) -> EdgeTokenizer:
    hf = AutoTokenizer.from_pretrained(resolve_model_dir(request.param))
    return EdgeTokenizer.from_bundle(TokenizerBundle.of_transformers(hf))


def stream_in_chunks(tokenizer, ids: list[int], stops, sizes) -> tuple[list[str], TextStream]:
    stream, pieces, at = TextStream(tokenizer, stops), [], 0
    for size in sizes:
        pieces.append(stream.push(ids[at : at + size]))
        at += size
    pieces.append(stream.push(ids[at:]))
    pieces.append(stream.finish())
    return pieces, stream


def test_the_stop_cut_is_at_the_earliest_stop_string():
    assert cut_at_stops("a, b; c, d", (";", ",")) == "a"
    assert cut_at_stops("a, b; c", ("; c", "x")) == "a, b"
    assert cut_at_stops("abc", ()) == "abc"


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_one_token_at_a_time_join_into_the_decoded_text_and_hold_no_broken_character(tokenizer, text):
    ids = tokenizer.encode_documents([text])[0]
    pieces, _ = stream_in_chunks(tokenizer, ids, (), [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces), pieces


def test_a_stop_string_is_never_released_not_even_its_first_characters(tokenizer):
    ids = tokenizer.encode_documents(["Count: 1, 2, 3, 4, 5, 6, 7, 8"])[0]
    pieces, stream = stream_in_chunks(tokenizer, ids, (" 5, 6",), [1] * len(ids))
    assert "".join(pieces) == "Count: 1, 2, 3, 4,"
    assert stream.stopped
    released = ""
    for p in pieces:  # no prefix of the stop string was let out and then had to be taken back
        released += p
        assert released == "Count: 1, 2, 3, 4,"[: len(released)]


def test_a_half_matched_stop_string_is_released_once_the_text_goes_another_way(tokenizer):
    ids = tokenizer.encode_documents(["one two three"])[0]
    pieces, stream = stream_in_chunks(tokenizer, ids, (" two four",), [1] * len(ids))
    assert "".join(pieces) == "one two three" and not stream.stopped


def test_an_output_that_ends_inside_a_character_releases_it_at_the_end_as_the_decoder_does(tokenizer):
    ids = tokenizer.encode_documents(["ok 🙂"])[0]
    cut = ids[:-1]  # the emoji's last byte token missing (both tokenizers spell 🙂 in several tokens)
    pieces, _ = stream_in_chunks(tokenizer, cut, (), [1] * len(cut))
    assert "".join(pieces) == tokenizer.decode(cut)
    assert all("\ufffd" not in p for p in pieces[:-1])


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
       stop=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=3),
       sizes=st.lists(st.integers(1, 4), max_size=30))
@example(text="00\x80", stop="0\x80", sizes=[3])  # a stop that starts before a character still incomplete
def test_any_text_streamed_in_any_chunks_joins_into_the_stop_cut_decoded_text(tokenizer, text, stop, sizes):
    ids = tokenizer.encode_documents([text])[0]
    pieces, stream = stream_in_chunks(tokenizer, ids, (stop,), sizes)
    assert "".join(pieces) == cut_at_stops(tokenizer.decode(ids), (stop,)) == stream.text
