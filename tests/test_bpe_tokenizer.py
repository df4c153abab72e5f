"""The edge's plain-Python tokenizer gives the same ids and the same text as the `tokenizers` library, which
the verifier runs: on both models' served tokenizers, on tokenizers trained here with the other steps it
implements (Metaspace, regex splits, digits, normalizers, unknown tokens, affixes, added-token options),
at every code point for the regex classes, and through its compiled form. What it does not implement it
refuses by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers

from specedge.bench import specbench
from specedge.edge import text_steps
from specedge.edge.bpe_tokenizer import BpeTokenizer
from specedge.edge.merge_table import EMPTY, MergeTable
from specedge.edge.unicode_regex import compile_onig

CORPUS = [p.text for p in specbench.load()][:400]
HARD = [" ", "  ", "\n", "\n\n\n", "\t", "\r\n", "\u2581", "\xa0", "\u3000", "\x1c", "\u0301", "🙂", "日本語",
        "é", "'s", "'LL", "123", "½", "3.14", "<0x41>", "> </", "<a> </a>", "<bos>", "<eos>", "<|im_end|>",
        "<table>", "[X]", " <y> ", "x[X]y", "\U00013721", "\U00031350"]
TEXT = st.lists(st.sampled_from(HARD) | st.sampled_from(CORPUS).map(lambda t: t[:80])
                | st.text(st.characters(exclude_categories=("Cs",)), max_size=10), max_size=8).map("".join)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_same(ours: BpeTokenizer, library: tokenizers.Tokenizer, text: str) -> None:
    for special in (True, False):
        ids = library.encode(text, add_special_tokens=special).ids
        assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == library.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_both_models_tokenizers_encode_and_decode_as_the_library_does(model):
    from transformers import AutoTokenizer

    from specedge.cloud.model_registry import resolve_model_dir
    from specedge.common.tokenizer_bundle import TokenizerBundle

    served = TokenizerBundle.of_transformers(AutoTokenizer.from_pretrained(resolve_model_dir(model))).tokenizer_json
    ours, library = BpeTokenizer.from_json(served), tokenizers.Tokenizer.from_str(served.decode())
    for text in [*CORPUS[:100], *HARD, "".join(HARD), "\n\n".join(CORPUS[:50])]:
        assert_same(ours, library, text)

    @SETTINGS
    @given(TEXT, st.lists(st.integers(0, ours.vocab_size - 1), max_size=12))
    def check(text, ids):
        assert_same(ours, library, text)
        for skip in (True, False):  # any ids, special ones and stray bytes included
            assert ours.decode(ids, skip) == library.decode(ids, skip_special_tokens=skip)

    check()


def trained(model: models.Model, pre_tokenizer, decoder, normalizer=None, post_processor=None,
            added: tuple = (), vocab_size: int = 600, **trainer_options) -> tokenizers.Tokenizer:
    """A tokenizer trained by the library on Spec-Bench text, with the given steps."""
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.decoder = normalizer, pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"], **trainer_options)
    tokenizer.train_from_iterator(CORPUS, trainer)
    if post_processor is not None:
        tokenizer.post_processor = post_processor(tokenizer)
    if added:
        tokenizer.add_tokens(list(added))
    return tokenizer


def bos_eos(tokenizer: tokenizers.Tokenizer) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", tokenizer.token_to_id("<s>")), ("</s>", tokenizer.token_to_id("</s>"))])


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TRAINED = {
    # SentencePiece-like: Metaspace, unknown characters fused, BOS and EOS by template.
    "metaspace": lambda: trained(
        models.BPE(unk_token="<unk>", fuse_unk=True), pre_tokenizers.Metaspace(prepend_scheme="first"),
        decoders.Metaspace(prepend_scheme="first"), post_processor=bos_eos, limit_alphabet=60),
    "metaspace-unsplit": lambda: trained(
        models.BPE(unk_token="<unk>"), pre_tokenizers.Metaspace(prepend_scheme="always", split=False),
        decoders.Metaspace(prepend_scheme="always"), limit_alphabet=60),
    # Llama 3 style: a regex split, then bytes; whole words in the vocabulary skip the merges.
    "regex-bytes": lambda: trained(
        models.BPE(ignore_merges=True),
        pre_tokenizers.Sequence([pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        decoders.ByteLevel(), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    "gpt2-prefix-space": lambda: trained(
        models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel(),
        post_processor=lambda _: processors.ByteLevel(), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        added=(AddedToken("[X]", single_word=True), AddedToken(" <y> ", lstrip=True, rstrip=True),
               AddedToken("é!", normalized=True))),
    # Normalizers, digits, word affixes, a Strip decoder, other split behaviours.
    "affixes": lambda: trained(
        models.BPE(unk_token="<unk>", continuing_subword_prefix="##", end_of_word_suffix="</w>"),
        pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Digits(True),
                                 pre_tokenizers.Split(tokenizers.Regex(r"\p{P}"), "merged_with_next")]),
        decoders.Strip("#", 0, 2), normalizer=normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Prepend("_"), normalizers.Replace("e", "E")]),
        continuing_subword_prefix="##", end_of_word_suffix="</w>", limit_alphabet=80),
    "contiguous-digits-no-decoder": lambda: trained(
        models.BPE(unk_token="<unk>"),
        pre_tokenizers.Sequence([pre_tokenizers.Split(tokenizers.Regex(r"\s+"), "merged_with_previous"),
                                 pre_tokenizers.Digits(False),
                                 pre_tokenizers.Split(tokenizers.Regex(r"[aeiou]"), "contiguous", invert=True)]),
        None, normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.Strip()]), limit_alphabet=80),
}


@pytest.mark.parametrize("name", TRAINED)
def test_tokenizers_with_the_other_implemented_steps_encode_and_decode_as_the_library_does(name):
    library = TRAINED[name]()
    ours = BpeTokenizer.from_json(library.to_str())
    for text in [*CORPUS[:50], *HARD, "".join(HARD)]:
        assert_same(ours, library, text)

    @SETTINGS
    @given(TEXT)
    def check(text):
        assert_same(ours, library, text)

    check()


@pytest.mark.parametrize("behavior", ["isolated", "removed", "merged_with_previous", "merged_with_next", "contiguous"])
@pytest.mark.parametrize("invert", [False, True])
def test_splits_cut_where_the_librarys_do_empty_matches_included(behavior, invert):
    ours_name = "".join(part.title() for part in behavior.split("_"))
    for pattern in [r"x*", r"\b", r"(?=a)", r" ?", r"\s*", r"b|", r"\p{L}+", r"[aeiou]"]:
        library = pre_tokenizers.Split(tokenizers.Regex(pattern), behavior, invert=invert)
        ours = text_steps.pre_tokenizer({"type": "Split", "pattern": {"Regex": pattern}, "behavior": ours_name,
                                         "invert": invert})
        for text in ["axxb", "xxa b", "ab a", "a", "  a  b", "aab", "bab ", "", "üb x"]:
            assert [w for w, _ in ours([(text, True)])] == [w for w, _ in library.pre_tokenize_str(text)], \
                (pattern, text)


def test_regex_classes_are_the_librarys_at_every_assigned_code_point():
    """\\p{L}, \\p{N} and \\s as the GPT-2 pattern uses them, probed through the library's pre-tokenizer:
    a letter joins "a_a" into one piece, a number "1_1", a space splits "x__x" into single spaces."""
    library = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ours = compile_onig(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    code_points = [c for c in [*range(0x40000), *range(0xE0000, 0xE1000)] if not 0xD800 <= c < 0xE000]
    for probe in ("a{}a", "1{}1", "x{}{}x"):
        for start in range(0, len(code_points), 50_000):
            chunk = [chr(c) for c in code_points[start:start + 50_000]]
            text = "\x00".join(probe.format(c, c) for c in chunk)
            theirs = [text[a:b] for _, (a, b) in library.pre_tokenize_str(text)]
            assert ours.findall(text) == theirs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)), max_size=300),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=50))
def test_the_merge_table_finds_every_pair_with_its_last_rank_and_no_other(rows, probes):
    size = 41
    table = MergeTable.build(np.array(rows, dtype=np.int64).reshape(-1, 3), size)
    want = {left * size + right: rank * size + merged for rank, (left, right, merged) in enumerate(rows)}
    for left, right in [(a, b) for a, b, _ in rows] + probes:
        assert table.get(left * size + right) == want.get(left * size + right, EMPTY)
    assert len(table.keys_array) >= 2 * len(want)  # at most half full: probes stay short


def test_the_compiled_form_loads_the_same_tokenizer(tmp_path):
    library = TRAINED["gpt2-prefix-space"]()
    ours = BpeTokenizer.from_json(library.to_str())
    ours.save(tmp_path)
    loaded = BpeTokenizer.load(tmp_path)
    assert loaded.get_vocab() == ours.get_vocab() == library.get_vocab(with_added_tokens=True)
    for text in CORPUS[:30] + HARD:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.vocab_size == library.get_vocab_size(with_added_tokens=True)


@pytest.mark.parametrize(("part", "step", "name"), [
    ("pre_tokenizer", {"type": "Whitespace"}, "Whitespace"),
    ("normalizer", {"type": "Precompiled", "precompiled_charsmap": ""}, "Precompiled"),
    ("decoder", {"type": "WordPiece", "prefix": "##", "cleanup": True}, "WordPiece"),
])
def test_a_step_it_does_not_implement_is_refused_by_name(part, step, name):
    spec = json.loads(TRAINED["metaspace"]().to_str())
    spec[part] = step
    with pytest.raises(ValueError, match=f"does not implement the .*'{name}'"):
        BpeTokenizer.from_json(json.dumps(spec))
    spec["model"]["type"] = "WordPiece"
    with pytest.raises(ValueError, match="BPE models only"):
        BpeTokenizer.from_json(json.dumps(spec))
