"""The steps of a Hugging Face `tokenizer.json` around its model, without the `tokenizers` library:
normalizers (text -> text), pre-tokenizers (text -> the words the model encodes one by one) and decoders
(token strings -> text), each built from its JSON spec with the library's semantics. A step not written
here is refused by name when the tokenizer is loaded, never approximated: a wrong token id would change
what the verifier is asked.

Pre-tokenizers work on `Word`s, (text, whether it starts the input), since Metaspace's `prepend_scheme:
first` marks only that one. They are plain tuples, and the common split runs in `re.split`: a datastore's
corpus is tens of millions of words.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from functools import lru_cache

from specedge.edge.byte_level import byte_level_chars, char_bytes
from specedge.edge.unicode_regex import WHITE_SPACE, category_class, compile_onig

Normalizer = Callable[[str], str]
Decoder = Callable[[list[str]], list[str]]
Word = tuple[str, bool]  # (text, begins at offset 0 of the encoded text)
PreTokenizer = Callable[[list[Word]], list[Word]]


class UnsupportedStep(ValueError):
    def __init__(self, part: str, spec: dict) -> None:
        super().__init__(f"the edge's tokenizer does not implement the {part} {spec.get('type')!r} "
                         f"(tokenizer.json: {_short(spec)})")


# --- normalizers -----------------------------------------------------------------------------------------
def normalizer(spec: dict | None) -> Normalizer:
    if spec is None:
        return lambda text: text
    kind = spec["type"]
    if kind == "Sequence":
        return _chained([normalizer(s) for s in spec["normalizers"]])
    if kind == "Replace":
        pattern = _pattern(spec["pattern"])
        return lambda text: pattern.sub(lambda _: spec["content"], text)
    if kind == "Prepend":
        return lambda text: spec["prepend"] + text if text else text
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Lowercase":
        return str.lower
    if kind == "Strip":
        return lambda text: _strip(text, spec["strip_left"], spec["strip_right"])
    raise UnsupportedStep("normalizer", spec)


def _strip(text: str, left: bool, right: bool) -> str:
    if left:
        text = text.lstrip(WHITE_SPACE)
    return text.rstrip(WHITE_SPACE) if right else text


# --- pre-tokenizers --------------------------------------------------------------------------------------
def pre_tokenizer(spec: dict | None) -> PreTokenizer:
    if spec is None:
        return lambda words: words
    kind = spec["type"]
    if kind == "Sequence":
        return _chained([pre_tokenizer(s) for s in spec["pretokenizers"]])
    if kind == "Split":
        pattern, behavior, invert = _pattern(spec["pattern"]), spec["behavior"], spec.get("invert", False)
        return lambda words: [w for word in words for w in split(word, pattern, behavior, invert)]
    if kind == "ByteLevel":
        return _byte_level(spec)
    if kind == "Metaspace":
        return _metaspace(spec)
    if kind == "Digits":
        digits = re.compile(f"[{category_class('N')}]")  # Rust's char::is_numeric
        behavior = "Isolated" if spec.get("individual_digits") else "Contiguous"
        return lambda words: [w for word in words for w in split(word, digits, behavior, False)]
    raise UnsupportedStep("pre-tokenizer", spec)


def split(word: Word, pattern: re.Pattern, behavior: str, invert: bool) -> list[Word]:
    """The library's split of one word by a pattern's matches (`SplitDelimiterBehavior`)."""
    text, at_start = word
    if behavior == "Isolated" and not pattern.groups:  # every piece in order: the first starts the word
        pieces = [p for p in _capturing(pattern).split(text) if p]
        return [(p, at_start and i == 0) for i, p in enumerate(pieces)]
    pieces: list[tuple[int, int, bool]] = []  # (start, end, is the delimiter), covering the text
    end = 0
    for m in pattern.finditer(text):  # an empty match splits too, as in the library
        if m.start() == m.end() == end > 0 and pieces and pieces[-1][2]:
            continue  # Oniguruma reports no empty match where the previous match ended (Python's re does)
        if m.start() > end:
            pieces.append((end, m.start(), False))
        pieces.append((m.start(), m.end(), True))
        end = m.end()
    if end < len(text):
        pieces.append((end, len(text), False))
    if invert:
        pieces = [(a, b, not is_delim) for a, b, is_delim in pieces]
    if behavior == "Removed":
        spans = [(a, b) for a, b, is_delim in pieces if not is_delim]
    elif behavior in ("MergedWithPrevious", "MergedWithNext"):
        backwards = behavior == "MergedWithNext"
        spans, previous_delim = [], False
        for a, b, is_delim in (reversed(pieces) if backwards else pieces):
            if is_delim and not previous_delim and spans:
                first, last = spans[-1]
                spans[-1] = (a, last) if backwards else (first, b)
            else:
                spans.append((a, b))
            previous_delim = is_delim
        if backwards:
            spans.reverse()
    elif behavior == "Isolated":
        spans = [(a, b) for a, b, _ in pieces]
    elif behavior == "Contiguous":
        spans, previous_delim = [], False
        for a, b, is_delim in pieces:
            if is_delim == previous_delim and spans:  # runs of either kind (inverted patterns make both)
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
            previous_delim = is_delim
    else:
        raise ValueError(f"unknown split behavior {behavior!r}")
    return [(text[a:b], at_start and a == 0) for a, b in spans if b > a]


@lru_cache(maxsize=64)
def _capturing(pattern: re.Pattern) -> re.Pattern:
    """`re.split` by this keeps the delimiters: gaps and matches alternate in its result."""
    return re.compile(f"({pattern.pattern})", pattern.flags)


GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _byte_level(spec: dict) -> PreTokenizer:
    """GPT-2's pre-tokenizer: optionally a leading space and its regex split, then every byte of the text
    spelled as its printable stand-in character."""
    pattern = compile_onig(GPT2_PATTERN) if spec.get("use_regex", True) else None
    prefix = spec.get("add_prefix_space", False)

    def pre_tokenize(words: list[Word]) -> list[Word]:
        out = []
        for text, at_start in words:
            if prefix and text and not text.startswith(" "):  # the library prepends to text only
                text = " " + text
            pieces = split((text, at_start), pattern, "Isolated", False) if pattern is not None else [(text, at_start)]
            out += [(byte_level_chars(piece), piece_at_start) for piece, piece_at_start in pieces]
        return out

    return pre_tokenize


def _metaspace(spec: dict) -> PreTokenizer:
    replacement = spec["replacement"]
    scheme = spec.get("prepend_scheme", "always" if spec.get("add_prefix_space", True) else "never")
    separator = re.compile(re.escape(replacement))

    def pre_tokenize(words: list[Word]) -> list[Word]:
        out = []
        for text, at_start in words:
            text = text.replace(" ", replacement)
            if text and not text.startswith(replacement) and (scheme == "always" or scheme == "first" and at_start):
                text = replacement + text
            out += split((text, at_start), separator, "MergedWithNext", False) if spec.get("split", True) \
                else [(text, at_start)]
        return out

    return pre_tokenize


# --- decoders --------------------------------------------------------------------------------------------
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def decoder(spec: dict | None) -> Decoder | None:
    """A decoder chain step: token strings -> token strings (the caller joins them). None: no decoder."""
    if spec is None:
        return None
    kind = spec["type"]
    if kind == "Sequence":
        return _chained([decoder(s) for s in spec["decoders"]])
    if kind == "ByteLevel":
        return _decode_byte_level
    if kind == "Replace":
        pattern = _pattern(spec["pattern"])
        return lambda tokens: [pattern.sub(lambda _: spec["content"], t) for t in tokens]
    if kind == "ByteFallback":
        return _decode_byte_fallback
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Strip":
        return lambda tokens: [_strip_chars(t, spec["content"], spec["start"], spec["stop"]) for t in tokens]
    if kind == "Metaspace":
        replacement = spec["replacement"]
        scheme = spec.get("prepend_scheme", "always" if spec.get("add_prefix_space", True) else "never")

        def metaspace(tokens: list[str]) -> list[str]:
            # As the library: the first token loses every replacement character, not only a leading one.
            first = "" if scheme != "never" else " "
            return [t.replace(replacement, first if i == 0 else " ") for i, t in enumerate(tokens)]

        return metaspace
    raise UnsupportedStep("decoder", spec)


def _decode_byte_level(tokens: list[str]) -> list[str]:
    table = char_bytes()
    data = bytearray()
    for token in tokens:
        spelled = [table.get(c) for c in token]
        data += token.encode("utf-8") if None in spelled else bytes(spelled)
    return [data.decode("utf-8", "replace")]


def _decode_byte_fallback(tokens: list[str]) -> list[str]:
    """Runs of `<0xNN>` tokens become their text; a run that is not UTF-8 becomes one U+FFFD per byte."""
    out: list[str] = []
    pending = bytearray()

    def flush() -> None:
        if pending:
            try:
                out.append(pending.decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" * len(pending))
            pending.clear()

    for token in tokens:
        m = BYTE_TOKEN.fullmatch(token) if len(token) == 6 else None
        if m is not None:
            pending.append(int(m.group(1), 16))
        else:
            flush()
            out.append(token)
    flush()
    return out


def _strip_chars(token: str, content: str, start: int, stop: int) -> str:
    begin, end = 0, len(token)
    while begin < min(start, len(token)) and token[begin] == content:
        begin += 1
    while len(token) - end < stop and end > begin and token[end - 1] == content:
        end -= 1
    return token[begin:end]


# --- shared ----------------------------------------------------------------------------------------------
def _chained(steps: list[Callable]) -> Callable:
    def chained(value):
        for step in steps:
            value = step(value)
        return value

    return chained


def _pattern(spec: dict) -> re.Pattern:
    if "String" in spec:
        return re.compile(re.escape(spec["String"]))
    return compile_onig(spec["Regex"])


def _short(spec: dict) -> str:
    text = str(spec)
    return text if len(text) <= 200 else text[:200] + "..."
