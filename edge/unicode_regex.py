"""Regular expressions of Hugging Face tokenizers (Oniguruma syntax) in Python's `re`.

Tokenizers split text with patterns such as GPT-2's `'s|'t| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`.
Python's `re` has no `\\p{..}`, and its `\\s` and `\\w` are not Oniguruma's (`\\s` there is Unicode's
White_Space: U+001C-U+001F are not spaces, as `str.isspace` says they are). So each such escape is written
out as an explicit character class from `unicodedata`. Its Unicode version is the running Python's (14.0 on
3.11) while the library's Oniguruma knows 16.0, so the letters and numbers assigned in between are added
from a table (NEWER_LETTERS_AND_NUMBERS); tests/test_bpe_tokenizer.py compares \\p{L}, \\p{N} and \\s with
the library's at every code point where Unicode assigns them. Other classes follow Python's version.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache, lru_cache
from itertools import groupby

# Unicode's White_Space property: Oniguruma's \s.
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
              "\u2028\u2029\u202f\u205f\u3000"
_SPACE_CLASS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
# Letters, marks, numbers, punctuation, symbols and separators are assigned in planes 0-3 and 14 only.
_SCANNED = (range(0x40000), range(0xE0000, 0xE1000))
_SUPPORTED_CATEGORIES = {"L", "M", "N", "P", "S", "Z"}
# Letters and numbers Unicode assigned in 15.0-16.0 (Kawi, Garay, Egyptian Hieroglyphs Extended-A, CJK
# Extensions H and I, ...): category Cn for Python 3.11, \p{L} / \p{N} for the `tokenizers` library.
NEWER_LETTERS_AND_NUMBERS = {
    "L": (
        (0x1C89, 0x1C8A), (0xA7CB, 0xA7CD), (0xA7DA, 0xA7DC), (0x105C0, 0x105F3), (0x10D4A, 0x10D65),
        (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x1123F, 0x11240), (0x11380, 0x11389), (0x1138B, 0x1138B),
        (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7), (0x113D1, 0x113D1), (0x113D3, 0x113D3),
        (0x11BC0, 0x11BE0), (0x11F02, 0x11F02), (0x11F04, 0x11F10), (0x11F12, 0x11F33), (0x1342F, 0x1342F),
        (0x13441, 0x13446), (0x13460, 0x143FA), (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF),
        (0x1B132, 0x1B132), (0x1B155, 0x1B155), (0x1DF25, 0x1DF2A), (0x1E030, 0x1E06D), (0x1E4D0, 0x1E4EB),
        (0x1E5D0, 0x1E5ED), (0x1E5F0, 0x1E5F0), (0x2B739, 0x2B739), (0x2EBF0, 0x2EE5D), (0x31350, 0x323AF),
    ),
    "N": (
        (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x11F50, 0x11F59), (0x16130, 0x16139),
        (0x16D70, 0x16D79), (0x1CCF0, 0x1CCF9), (0x1D2C0, 0x1D2D3), (0x1E4F0, 0x1E4F9), (0x1E5F1, 0x1E5FA),
    ),
}


def compile_onig(pattern: str) -> re.Pattern:
    """An Oniguruma pattern as tokenizers use them, compiled by `re` with the same matches."""
    return re.compile(translate(pattern))


def translate(pattern: str) -> str:
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escape, i = _escape_at(pattern, i)
            out.append(_class_body(escape, in_class))
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if pattern.startswith("^", i + 1):
                out.append("^")
                i += 1
            if pattern.startswith("]", i + 1):  # a leading ] is a literal
                out.append("\\]")
                i += 1
        elif c == "[" and in_class:
            raise ValueError(f"nested character classes are not supported in tokenizer pattern {pattern!r}")
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _escape_at(pattern: str, i: int) -> tuple[str, int]:
    """The escape starting at pattern[i] ('\\'), and the index after it."""
    kind = pattern[i + 1]
    if kind in "pP":
        if pattern.startswith("{", i + 2):
            end = pattern.index("}", i + 2)
            return pattern[i:end + 1], end + 1
        return pattern[i:i + 3], i + 3
    return pattern[i:i + 2], i + 2


def _class_body(escape: str, in_class: bool) -> str:
    """An escape as `re` source: a class body inside [...], a bracketed class outside."""
    kind = escape[1]
    if kind in "pP":
        name = escape[2:].strip("{}")
        if name.startswith("^"):
            kind, name = ("P" if kind == "p" else "p"), name[1:]
        body, negated = category_class(name), kind == "P"
    elif kind in "sS":
        body, negated = _SPACE_CLASS, kind == "S"
    elif kind in "wW":  # Oniguruma's Unicode \w: letters, marks, decimal numbers, connector punctuation
        body, negated = category_class("L") + category_class("M") + category_class("Nd") + category_class("Pc"), \
            kind == "W"
    elif kind in "dD":
        body, negated = category_class("Nd"), kind == "D"
    else:
        return escape
    if in_class:
        if negated:
            raise ValueError(f"a negated class escape ({escape}) inside [...] is not supported")
        return body
    return f"[{'^' if negated else ''}{body}]"


@cache
def category_class(name: str) -> str:
    """The code points of a Unicode general category ("L", "N", "Lu", ...) as ranges of a class body."""
    name = {"Letter": "L", "Mark": "M", "Number": "N", "Punctuation": "P", "Symbol": "S", "Separator": "Z"}.get(
        name, name)
    if name[:1] not in _SUPPORTED_CATEGORIES or len(name) > 2:
        raise ValueError(f"Unicode property \\p{{{name}}} is not supported in tokenizer patterns")
    runs = sorted([r for category, ranges in _category_runs().items() if category.startswith(name) for r in ranges]
                  + list(NEWER_LETTERS_AND_NUMBERS.get(name, ())))
    merged: list[list[int]] = []
    for first, last in runs:
        if merged and merged[-1][1] >= first - 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return "".join(_char(a) if a == b else f"{_char(a)}-{_char(b)}" for a, b in merged)


@lru_cache(maxsize=1)
def _category_runs() -> dict[str, list[tuple[int, int]]]:
    """Each two-letter general category's runs of consecutive code points (one pass, ~40 ms)."""
    runs: dict[str, list[tuple[int, int]]] = {}
    for scanned in _SCANNED:
        cp = scanned.start
        for category, members in groupby(map(unicodedata.category, map(chr, scanned))):
            n = sum(1 for _ in members)
            runs.setdefault(category, []).append((cp, cp + n - 1))
            cp += n
    return runs


def _char(cp: int) -> str:
    return f"\\U{cp:08x}"
