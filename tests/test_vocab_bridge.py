"""The bridge between a drafter's vocabulary (SmolLM2, byte-level BPE, 49k) and the target's (Gemma 3,
SentencePiece-style with byte fallback, 262k): true token bytes, the shared-vocabulary map, the drafter's
context resynchronised to committed text, and drafted text in the target's tokenisations. Hard text
(spaces, newlines, tabs, digits, emoji, CJK, accents, indented code, special tokens) and random text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.cloud.model_registry import resolve_model_dir
from specedge.edge.bpe_tokenizer import BpeTokenizer
from specedge.edge.draft_model import DraftModel
from specedge.edge.draft_models import draft_model_path
from specedge.edge.token_bytes import token_bytes
from specedge.edge.tokenizer import render_chat
from specedge.edge.vocab_bridge import CrossVocab, bridge_between, complete_utf8, end_map, vocab_map

pytestmark = pytest.mark.real_model

HARD = [
    "Hello world", "  two leading spaces", "trailing spaces   ", "line one\nline two\n\n", "tab\tseparated\tvalues",
    "3.14159 and 1,000,000 and 2026-11-23", "emoji 🙂🚀👩‍💻 end", "中文文本和日本語のテキスト",
    "naïve café résumé Ångström",
    "def f(x):\n    if x:\n        return [i ** 2 for i in x]\n", "<b>bold</b> & entities &amp;", " ", "\n",
    "mixed 🙂 CJK 字 and accents é\t\n", "ends in an emoji 🙂",
]
MISSING = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])  # SmolLM2's
# Text that stresses tokenisers: the hard pieces above mixed with any characters.
TEXT = st.lists(st.sampled_from(HARD) | st.text(min_size=1, max_size=12), min_size=1, max_size=6).map("".join)


@pytest.fixture(scope="module")
def target() -> BpeTokenizer:
    return BpeTokenizer.from_json((resolve_model_dir("gemma3-270m") / "tokenizer.json").read_bytes())


@pytest.fixture(scope="module")
def drafter_tokenizer() -> BpeTokenizer:
    return BpeTokenizer.from_json((resolve_model_dir("smollm2-135m") / "tokenizer.json").read_bytes())


@pytest.fixture(scope="module")
def drafter() -> DraftModel:
    return DraftModel(draft_model_path("smollm2-135m"), context=512)


@pytest.fixture(scope="module")
def bridge(drafter, target) -> CrossVocab:
    return CrossVocab(drafter.token_bytes(), token_bytes(target), target, drafter.tokenize, drafter.bos_id, {})


@pytest.mark.parametrize("which", ["target", "drafter_tokenizer"])
def test_token_bytes_spell_the_encoded_text(request, which):
    tok = request.getfixturevalue(which)
    table = token_bytes(tok)

    @settings(max_examples=150, deadline=None)
    @given(TEXT)
    def check(text):
        ids = tok.encode(text, add_special_tokens=False)
        spelled = b"".join(table[i] for i in ids)
        if tok.decode(ids) == text:
            assert spelled == text.encode("utf-8")
        else:  # a character the vocabulary cannot spell (SmolLM2 lacks a few bytes): the decoder agrees
            assert spelled.decode("utf-8", "replace") == tok.decode(ids)

    check()
    rng = np.random.default_rng(0)
    textual = [i for i, b in enumerate(table) if b is not None]
    for _ in range(300):  # any id sequence: bytes decode as the tokenizer decodes it
        ids = rng.choice(textual, size=6).tolist()
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == tok.decode(ids)


def test_llama_cpp_and_hugging_face_agree_on_the_drafter_token_bytes(drafter, drafter_tokenizer):
    assert drafter.token_bytes() == token_bytes(drafter_tokenizer)


def test_the_shared_map_is_never_wrong_and_beats_space_sign_matching(drafter_tokenizer, target):
    drafter_bytes, target_bytes = token_bytes(drafter_tokenizer), token_bytes(target)
    shared = vocab_map(drafter_bytes, target_bytes)
    mapped = np.flatnonzero(shared >= 0)
    assert all(drafter_bytes[i] == target_bytes[shared[i]] for i in mapped)
    assert len(set(shared[mapped].tolist())) == len(mapped)  # one drafter id per target id
    # What transformers' and vLLM's maps do: rewrite the leading-space sign and compare strings.
    target_vocab = target.get_vocab()
    by_string = {i: target_vocab[piece.replace("Ġ", "▁")] for piece, i in drafter_tokenizer.get_vocab().items()
                 if piece.replace("Ġ", "▁") in target_vocab}
    right = sum(drafter_bytes[i] == target_bytes[j] for i, j in by_string.items())
    print(f"shared tokens: by bytes {len(mapped)}; by space sign {len(by_string)} ({len(by_string) - right} wrong)")
    assert len(mapped) > right
    assert len(by_string) > right  # string matching maps some tokens to different text
    newline = drafter_tokenizer.token_to_id("Ċ")  # byte-level's stand-in for "\n"
    assert target_bytes[shared[newline]] == b"\n"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=20), st.integers(min_value=0, max_value=80))
def test_complete_utf8_keeps_the_longest_whole_character_prefix(text, cut):
    raw = text.encode("utf-8")[:cut]
    kept = complete_utf8(raw)
    kept.decode("utf-8")  # whole characters
    assert raw.startswith(kept) and len(raw) - len(kept) < 4
    longest = max(k for k in range(len(raw) + 1) if _decodes(raw[:k]))
    assert len(kept) == longest


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_the_drafter_context_follows_committed_text_in_any_pieces(bridge, target):
    assert bridge.unspellable == MISSING
    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(TEXT, st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=30))
    def check(text, pieces):
        ids = target.encode(text, add_special_tokens=False)
        context = bridge.begin([2])  # the target's BOS: a special token, not text
        assert b"".join(bridge.drafter_bytes[t] for t in context) == b""
        at = 0
        for size in pieces + [len(ids)]:
            previewed = bridge.preview(ids[at : at + size])  # commits nothing: the commit below gives the same
            context = bridge.commit(ids[at : at + size])
            assert previewed == context
            at = min(len(ids), at + size)
            committed = b"".join(bridge.target_bytes[t] for t in ids[:at])
            assert b"".join(bridge.drafter_bytes[t] for t in context) == _spellable(complete_utf8(committed))
            assert bridge.pending == (complete_utf8(committed) != committed)

    check()


def test_whether_a_context_may_follow_a_commit_is_never_no_for_the_context_that_follows(bridge, target):
    """`may_become` answers from bytes, without re-tokenising; a no must be right (a wrong no only costs the
    hybrid a model draft, but it must not happen), and it must say no to contexts that spell other text."""
    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(TEXT, st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=12))
    def check(text, pieces):
        ids = target.encode(text, add_special_tokens=False)
        bridge.begin([2])
        at = 0
        for size in pieces:
            new = ids[at : at + size]
            assert bridge.may_become(new, [tuple(bridge.preview(new))])
            bridge.commit(new)
            at += size

    check()
    bridge.begin(target.encode("The cat sat on the", add_special_tokens=False))
    mat, dog = target.encode(" mat", add_special_tokens=False), target.encode(" dog", add_special_tokens=False)
    after_mat = tuple(bridge.preview(mat))
    assert bridge.may_become(mat, [after_mat]) and not bridge.may_become(dog, [after_mat])
    assert not bridge.may_become(dog, []) and bridge.may_become(dog, [after_mat, tuple(bridge.preview(dog))])


def test_drafted_text_becomes_target_ids_that_spell_it(bridge, target):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(TEXT, TEXT, st.integers(min_value=0, max_value=60))
    def check(committed, drafted, cut):
        bridge.begin(target.encode(committed, add_special_tokens=False))
        raw = drafted.encode("utf-8")[:cut]  # drafts can end inside a character
        variants = bridge.target_drafts(raw)
        assert len(variants) <= 2
        for variant in variants:
            spelled = b"".join(bridge.target_bytes[t] for t in variant.ids)
            assert spelled == complete_utf8(raw)
            assert variant.text_ends == np.cumsum([len(bridge.target_bytes[t]) for t in variant.ids]).tolist()
        if complete_utf8(raw):
            assert variants and variants[0].ids == target.encode(complete_utf8(raw).decode(),
                                                                 add_special_tokens=False)

    check()


def _spellable(raw: bytes) -> bytes:
    """What SmolLM2 can spell of a text: characters made only of bytes it has tokens for."""
    return "".join(ch for ch in raw.decode("utf-8") if not set(ch.encode("utf-8")) & set(MISSING)).encode("utf-8")


def test_a_draft_that_would_merge_with_committed_text_gets_the_standalone_tokenisation_only(bridge, target):
    """"I like" + "s apples": in context, "likes" would be one token straddling committed ids, which are
    fixed; the target must continue "I like" with "s", so that is what is offered."""
    bridge.begin(target.encode("I like", add_special_tokens=False))
    (only,) = bridge.target_drafts(b"s apples")
    assert only.ids == target.encode("s apples", add_special_tokens=False)


def test_end_of_turn_maps_to_end_of_turn():
    drafter_ends = {0: "<|endoftext|>", 2: "<|im_end|>"}
    assert end_map(drafter_ends, {1: "<eos>", 106: "<end_of_turn>"}) == {0: 1, 2: 106}
    assert end_map(drafter_ends, {1: "<eos>"}) == {0: 1, 2: 1}
    assert end_map(drafter_ends, {}) == {}


def test_a_chat_prompt_reaches_the_drafter_in_its_own_template(drafter, target):
    """A Gemma-turns prompt becomes the same conversation in SmolLM2's ChatML (its GGUF's template); what
    the target then commits follows it as text; a plain prompt stays text."""
    from tests.test_chat_turns import renderer

    gemma = renderer("gemma")
    bridge = bridge_between(drafter, target, {}, target_template=gemma)
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another one, please."}]
    own = render_chat(drafter.chat_template, conversation, drafter.special_tokens)
    assert own.startswith("<|im_start|>") and "<start_of_turn>" not in own
    context = list(bridge.begin(target.encode(gemma(conversation), add_special_tokens=False)))
    assert context == drafter.tokenize(own, special=True)
    assert bridge.commit(target.encode("Green, like grass", add_special_tokens=False)) == \
        context + drafter.tokenize("Green, like grass")
    assert bridge.begin(target.encode("Once upon a time", add_special_tokens=False)) == \
        drafter.tokenize("Once upon a time")
