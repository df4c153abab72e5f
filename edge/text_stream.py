"""The text of a growing output, released in pieces that never have to be taken back.

Decoding each round's new tokens on their own is wrong (a character's bytes can span tokens, and a
tokenizer's decoder may join or strip spaces across them), so the whole output is decoded each time and
only the part that can no longer change is released: not an incomplete character at the end (U+FFFD while
its bytes are still coming), not the start of a stop string, not what the tokenizer's space clean-up might
still rewrite. The pieces joined are the final text: the output cut before its first stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"
CLEAN_UP_REACH = 3  # characters that transformers' space clean-up (" n't", " 's", " .") rewrites back


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` cut before the earliest occurrence of any stop string."""
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


def tokens_of(tokenizer, token_ids: Sequence[int], text: str) -> list[int]:
    """The longest start of `token_ids` whose decoded text lies within `text` (an output's text cut before a
    stop string: the tokens of the stop string, and one that straddles its start, are left out)."""
    n = len(token_ids)
    while n and not text.startswith(tokenizer.decode(token_ids[:n])):
        n -= 1
    return list(token_ids[:n])


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.token_ids: list[int] = []
        self.stopped = False  # the output contains a stop string: nothing after it will be released
        self._released = 0  # characters of the text handed out so far

    @property
    def text(self) -> str:
        """The output's text so far (cut before a stop string), including what is still held back."""
        return cut_at_stops(self.tokenizer.decode(self.token_ids), self.stops)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add committed tokens; the text that became final (possibly empty)."""
        self.token_ids.extend(token_ids)
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids)
        text = cut_at_stops(full, self.stops)
        if len(text) < len(full):
            self.stopped = True
            return self._release(len(text), text)
        return self._release(len(text) - self._held_back(text), text)

    def finish(self) -> str:
        """Everything not yet released (the output is complete: an incomplete character stays U+FFFD)."""
        if self.stopped:
            return ""
        text = self.text
        return self._release(len(text), text)

    def _release(self, end: int, text: str) -> str:
        piece = text[self._released : end] if end > self._released else ""
        self._released = max(self._released, end)
        return piece

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` that may still change: an incomplete character, and before it
        the longest end that a stop string starts with (or what the space clean-up may rewrite)."""
        settled = text.rstrip(REPLACEMENT)
        held = 0
        for stop in self.stops:
            held = max(held, next((n for n in range(min(len(stop) - 1, len(settled)), 0, -1)
                                   if settled.endswith(stop[:n])), 0))
        if getattr(self.tokenizer, "clean_up_spaces", False):
            held = max(held, CLEAN_UP_REACH)
        return len(text) - len(settled) + held
