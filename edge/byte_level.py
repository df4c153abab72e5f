"""GPT-2's byte-level spelling: every byte of text as one printable character (printable Latin-1 bytes
stand for themselves, the others for 256 + their rank), which byte-level BPE vocabularies are written in
(`Ġ` is a space, `Ċ` a newline, `Ã©` is "é")."""

from __future__ import annotations

from functools import lru_cache

_SPELLED: dict[str, str] = {}  # memo of byte_level_chars
_MEMO_WORDS = 100_000


@lru_cache(maxsize=1)
def byte_chars() -> str:
    """The stand-in character of each byte 0-255."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return "".join(chars)


@lru_cache(maxsize=1)
def _to_byte_chars() -> dict[int, str]:
    return {b: c for b, c in enumerate(byte_chars())}


@lru_cache(maxsize=1)
def char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_chars())}


def forget_words() -> None:
    _SPELLED.clear()


def byte_level_chars(text: str) -> str:
    """`text`'s bytes spelled in GPT-2's stand-in characters (memoised: words repeat)."""
    spelled = _SPELLED.get(text)
    if spelled is None:
        spelled = text.encode("utf-8").decode("latin-1").translate(_to_byte_chars())
        if len(_SPELLED) >= _MEMO_WORDS:
            _SPELLED.clear()
        _SPELLED[text] = spelled
    return spelled
