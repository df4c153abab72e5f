"""A Hugging Face `tokenizer.json` with a BPE model, run in plain Python: the edge's tokenizer, without the
`tokenizers` library (11 MB, and 31 MB of Hub client it requires) or transformers.

Encoding follows the library step by step: added tokens are cut out of the raw text first (leftmost, then
longest), each remaining piece is normalized and pre-tokenized into words, the BPE model encodes each
word, and the post-processor adds the special tokens (e.g. Gemma's BOS). Decoding runs the token strings
through the decoder chain. tests/test_bpe_tokenizer.py checks ids and text against the library on both
models and on random text; a tokenizer using a step not written here is refused by name when loaded.

Loading the JSON of a 262k-token vocabulary (Gemma 3: 14 MB, 515k merges) takes ~1.5 s and ~290 MB at
peak, so a fetched tokenizer is also kept compiled (`save`/`load`: token strings as one marshal blob,
merges as their hash table's arrays, edge/merge_table.py).
"""

from __future__ import annotations

import json
import marshal
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specedge.edge import byte_level, text_steps
from specedge.edge.bpe import BpeModel
from specedge.edge.merge_table import MergeTable
from specedge.edge.unicode_regex import WHITE_SPACE, compile_onig

COMPILED_FORMAT = 2


@dataclass(frozen=True)
class AddedToken:
    id: int
    content: str
    special: bool = False
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


class BpeTokenizer:
    def __init__(self, model: BpeModel, added_tokens: list[AddedToken], steps: dict) -> None:
        """`steps`: the tokenizer.json's normalizer, pre_tokenizer, post_processor and decoder specs."""
        self.model = model
        self.steps = steps
        self.added = {t.id: t for t in added_tokens}
        self._added_ids = {t.content: t.id for t in added_tokens}
        self._normalize = text_steps.normalizer(steps.get("normalizer"))
        self._pre_tokenize = text_steps.pre_tokenizer(steps.get("pre_tokenizer"))
        self._decode = text_steps.decoder(steps.get("decoder"))
        self._template = _single_template(steps.get("post_processor"))
        if any(t.normalized and self._normalize(t.content) != t.content for t in added_tokens):
            raise ValueError("the edge's tokenizer does not implement added tokens matched after normalization "
                             "(normalized: true) whose text the normalizer changes")
        # As the library: tokens that are not normalized are cut from the raw text, the others from each
        # remaining piece once normalized.
        self._raw_tokens = _AddedTokenMatcher([t for t in added_tokens if not t.normalized])
        self._normalized_tokens = _AddedTokenMatcher([t for t in added_tokens if t.normalized])

    # --- loading -----------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> BpeTokenizer:
        spec = json.loads(text)
        if spec.get("truncation") or spec.get("padding"):
            raise ValueError("the edge's tokenizer does not truncate or pad; the tokenizer.json asks for it")
        added = [_added_token(a) for a in spec.get("added_tokens") or []]
        return cls(BpeModel.from_json(spec["model"]), added, _steps_of(spec))

    def save(self, directory: Path) -> None:
        """The compiled form, for `load`: much faster than the JSON for large vocabularies."""
        directory = Path(directory)
        (directory / "tokens.marshal").write_bytes(marshal.dumps(self.model.tokens))
        np.save(directory / "merge_keys.npy", self.model.merges.keys_array)
        np.save(directory / "merge_values.npy", self.model.merges.values_array)
        model = {"byte_fallback": self.model.byte_fallback, "fuse_unk": self.model.fuse_unk,
                 "continuing_subword_prefix": self.model.prefix, "end_of_word_suffix": self.model.suffix,
                 "ignore_merges": self.model.ignore_merges,
                 "unk_token": None if self.model.unk_id is None else self.model.tokens[self.model.unk_id]}
        (directory / "tokenizer.compiled.json").write_text(json.dumps(
            {"format": COMPILED_FORMAT, "model": model, "steps": self.steps,
             "added_tokens": [asdict(t) for t in self.added.values()]}, ensure_ascii=False))

    @classmethod
    def load(cls, directory: Path) -> BpeTokenizer:
        directory = Path(directory)
        config = json.loads((directory / "tokenizer.compiled.json").read_text())
        if config.get("format") != COMPILED_FORMAT:
            raise ValueError(f"{directory}: compiled tokenizer of another format")
        tokens = marshal.loads((directory / "tokens.marshal").read_bytes())
        merges = MergeTable(np.load(directory / "merge_keys.npy"), np.load(directory / "merge_values.npy"))
        model = BpeModel(tokens, merges, **config["model"])
        return cls(model, [AddedToken(**a) for a in config["added_tokens"]], config["steps"])

    # --- the vocabulary -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """One more than the largest id (added tokens included)."""
        return max(self.model.size, max(self.added, default=-1) + 1)

    def get_vocab(self) -> dict[str, int]:
        """Every token and its id, added tokens included."""
        vocab = {t: i for i, t in enumerate(self.model.tokens) if t is not None}
        vocab.update(self._added_ids)
        return vocab

    def token_to_id(self, token: str) -> int | None:
        """An added token's id, else a search of the vocabulary (for the few named special tokens)."""
        if token in self._added_ids:
            return self._added_ids[token]
        try:
            return self.model.tokens.index(token)
        except ValueError:
            return None

    def id_to_token(self, i: int) -> str | None:
        added = self.added.get(i)
        if added is not None:
            return added.content
        return self.model.tokens[i] if 0 <= i < self.model.size else None

    def is_special(self, i: int) -> bool:
        added = self.added.get(i)
        return added is not None and added.special

    # --- encoding and decoding ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for start, piece, added in self._raw_tokens.split(text):
            if added is not None:
                ids.append(added)
                continue
            for inner_start, inner, inner_added in self._normalized_tokens.split(self._normalize(piece)):
                if inner_added is not None:
                    ids.append(inner_added)
                    continue
                for word, _ in self._pre_tokenize([(inner, start == 0 and inner_start == 0)]):
                    ids += self.model.encode(word)
        return self._with_special_tokens(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        tokens = [t for i in ids if (t := self.id_to_token(i)) is not None
                  and not (skip_special_tokens and self.is_special(i))]
        return "".join(self._decode(tokens)) if self._decode is not None else " ".join(tokens)

    def forget_words(self) -> None:
        """Empty the memos of words already encoded (for timing a client that has seen no text yet)."""
        self.model.forget_words()
        byte_level.forget_words()

    def _with_special_tokens(self, ids: list[int]) -> list[int]:
        out: list[int] = []
        for piece in self._template:
            out += ids if piece is None else piece
        return out


class _AddedTokenMatcher:
    """Cuts added tokens out of text as the library's Aho-Corasick trie does (leftmost, then longest)."""

    def __init__(self, tokens: list[AddedToken]) -> None:
        self.tokens = {t.content: t for t in tokens if t.content}
        lengths: dict[str, set[int]] = {}
        for content in self.tokens:
            lengths.setdefault(content[0], set()).add(len(content))
        self.lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self.starts = re.compile("[" + "".join(map(re.escape, sorted(lengths))) + "]") if lengths else None
        # Oniguruma's \w, for single-word tokens only: its classes take ~40 ms to build
        self.word = compile_onig(r"\w") if any(t.single_word for t in tokens) else None

    def split(self, text: str) -> list[tuple[int, str, int | None]]:
        """(start, text, added token id or None) pieces covering `text`; never an empty text piece."""
        if self.starts is None or not text:
            return [(0, text, None)]
        pieces: list[tuple[int, str, int | None]] = []
        done = 0  # text before this offset is in pieces
        scan = 0  # the next match starts here or later
        while (m := self.starts.search(text, scan)) is not None:
            at = m.start()
            token = next((t for n in self.lengths[text[at]] if (t := self.tokens.get(text[at:at + n]))), None)
            if token is None:
                scan = at + 1
                continue
            start, stop = at, at + len(token.content)
            scan = stop  # the next match is searched after the token itself, not after what it strips
            if token.single_word and ((start > 0 and self.word.match(text[start - 1]))
                                      or (stop < len(text) and self.word.match(text[stop]))):
                continue
            if token.lstrip:
                start = max(len(text[:start].rstrip(WHITE_SPACE)), done)
            if token.rstrip:
                stop = len(text) - len(text[stop:].lstrip(WHITE_SPACE))
            if done < start:
                pieces.append((done, text[done:start], None))
            pieces.append((start, text[start:stop], token.id))
            done = stop
        if done < len(text):
            pieces.append((done, text[done:], None))
        return pieces


def _added_token(spec: dict) -> AddedToken:
    return AddedToken(id=spec["id"], content=spec["content"], special=spec.get("special", False),
                      single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                      rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", False))


def _steps_of(spec: dict) -> dict:
    return {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")}


def _single_template(spec: dict | None) -> list[list[int] | None]:
    """What `encode(add_special_tokens=True)` makes of one sequence: special tokens' ids around None (the
    text's ids)."""
    if spec is None:
        return [None]
    kind = spec["type"]
    if kind == "Sequence":
        template = [None]
        for step in spec["processors"]:
            inner = _single_template(step)
            template = [p for q in inner for p in (template if q is None else [q])]
        return template
    if kind == "ByteLevel":  # only trims offsets
        return [None]
    if kind == "TemplateProcessing":
        template = []
        for piece in spec["single"]:
            if "Sequence" in piece:
                template.append(None)
            else:
                template.append(list(spec["special_tokens"][piece["SpecialToken"]["id"]]["ids"]))
        return template
    if kind in ("RobertaProcessing", "BertProcessing"):
        return [[spec["cls"][1]], None, [spec["sep"][1]]]
    raise text_steps.UnsupportedStep("post-processor", spec)

