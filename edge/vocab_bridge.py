"""Between a drafter's vocabulary and the target's (Timor et al., ICML 2025; DESIGN.md "Drafting with a
model").

- `SameVocab`: the drafter's ids are the target's.
- `CrossVocab`: everything goes through the tokens' true bytes (edge/token_bytes.py):
  * the drafter's context is its own tokenisation of the committed text, resynchronised after every
    verdict from the last few tokens on (so a word the target split differently is re-merged), never by
    re-splitting the target's committed ids, which are fixed; a chat prompt is the same conversation in
    the drafter's own chat template, when both models have one (edge/chat_turns.py);
  * SLEM (greedy): drafted text, trimmed to whole UTF-8 characters, becomes target ids by the target's own
    tokenizer, standalone and in the context of the committed text's tail (the two are sibling branches
    when they differ); the verifier's exact match does the rest;
  * TLI (sampling): the `shared` map (drafter id -> target id with identical bytes, -1 if none) restricts
    the drafter to tokens that exist on both sides, so a sampled draft is a target draft one for one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from specedge.edge.bpe_tokenizer import BpeTokenizer
from specedge.edge.chat_turns import Render, conversation_of

LOOKBEHIND_TOKENS = 2  # drafter tokens re-tokenised after each verdict: boundary merges reach this far back
LOOKBEHIND_CHARS = 16  # committed text the target re-tokenises a draft behind
ENDING_TOKENS = 4  # a context's last tokens whose bytes `may_become` compares with the committed text's end


@dataclass
class TargetDraft:
    """One tokenisation of drafted text in target ids, and how much drafted text each id covers."""

    ids: list[int]
    text_ends: list[int]  # end of each id's text, in bytes of the drafted text


def complete_utf8(raw: bytes) -> bytes:
    """`raw` without a trailing incomplete UTF-8 character."""
    back = 0  # continuation bytes at the end
    while back < min(3, len(raw)) and 0x80 <= raw[-1 - back] < 0xC0:
        back += 1
    if back == len(raw) or raw[-1 - back] < 0x80:
        return raw
    lead = raw[-1 - back]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return raw if back + 1 >= need else raw[: -1 - back]


def vocab_map(drafter_bytes: list[bytes | None], target_bytes: list[bytes | None]) -> np.ndarray:
    """drafter id -> the target id with the same bytes, -1 where the target has no such token."""
    target_of: dict[bytes, int] = {}
    for i, b in enumerate(target_bytes):
        if b:
            target_of.setdefault(b, i)
    out = np.full(len(drafter_bytes), -1, dtype=np.int64)
    for i, b in enumerate(drafter_bytes):
        if b and (t := target_of.pop(b, None)) is not None:  # pop: one drafter id per target id
            out[i] = t
    return out


class SameVocab:
    cross = False

    def begin(self, prompt_ids: list[int]) -> list[int]:
        self.ids = list(prompt_ids)
        return self.ids

    def commit(self, target_ids: list[int]) -> list[int]:
        self.ids.extend(target_ids)
        return self.ids

    def preview(self, target_ids: list[int]) -> list[int]:
        """The drafter's context if `target_ids` were committed next (nothing is committed)."""
        return self.ids + list(target_ids)

    def may_become(self, target_ids: list[int], contexts: Iterable[tuple[int, ...]]) -> bool:
        """Whether one of `contexts` may be the drafter's context once `target_ids` are committed (CrossVocab's
        question; here committing is cheap enough to ask `preview` instead)."""
        return True


class CrossVocab:
    cross = True

    def __init__(self, drafter_bytes: list[bytes | None], target_bytes: list[bytes | None],
                 target: BpeTokenizer, tokenize: Callable[..., list[int]], bos_id: int | None,
                 end_ids: dict[int, int], chat: tuple[Render, Render] | None = None) -> None:
        self.drafter_bytes = drafter_bytes
        self.target_bytes = target_bytes
        self.target = target
        self.tokenize = tokenize  # (text, special=False) -> drafter ids (no BOS)
        self.chat = chat  # the target's chat template and the drafter's, as renderers
        self.bos = [] if bos_id is None else [bos_id]
        self.end_ids = end_ids  # drafter end-of-turn/EOS ids -> the target's
        self.shared = vocab_map(drafter_bytes, target_bytes)
        self.targets = self.shared.copy()  # what a drafter id stands for in a sampled (TLI) draft
        for drafter_end, target_end in end_ids.items():
            if target_end not in self.targets:
                self.targets[drafter_end] = target_end
        self.allowed = self.targets >= 0
        singles = {b for b in drafter_bytes if b is not None and len(b) == 1}
        self.unspellable = bytes(b for b in range(256) if bytes([b]) not in singles)

    # --- the drafter's context ----------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> list[int]:
        conversation = self._in_own_template(prompt_ids)
        self.committed = b""  # the prompt's text too, unless it is a conversation in the drafter's template
        self.ids = list(self.bos) if conversation is None else conversation
        self.ends = [0] * len(self.ids)  # committed bytes covered after each drafter id
        self._fixed = self._checked = len(self.ids)  # ids before _fixed are never re-tokenised
        return self.ids if conversation is not None else self.commit(prompt_ids)

    def _in_own_template(self, prompt_ids: list[int]) -> list[int] | None:
        """A chat prompt's conversation rendered by the drafter's template, in drafter ids."""
        if self.chat is None:
            return None
        target_template, drafter_template = self.chat
        turns = conversation_of(self.target.decode(prompt_ids, skip_special_tokens=False), target_template)
        if turns is None:
            return None
        ids = self.tokenize(drafter_template(turns), special=True)
        return ids if ids[:1] == self.bos else self.bos + ids

    def commit(self, target_ids: list[int]) -> list[int]:
        """Append the target's newly committed ids; returns the drafter's context for what is committed."""
        self.committed += b"".join(self.target_bytes[t] or b"" for t in target_ids)
        keep = self._checked  # ids before it spell the committed text: it only grows
        while keep < len(self.ids) and self.ends[keep] <= len(self.committed) and \
                self._bytes_of(keep) == self.committed[self.ends[keep] - len(self._bytes_of(keep)) : self.ends[keep]]:
            keep += 1
        keep = max(self._fixed, keep - LOOKBEHIND_TOKENS)
        # Re-tokenise from a character boundary: a drafter token may end inside a character.
        while keep > self._fixed and self._inside_character(self.ends[keep - 1]):
            keep -= 1
        start = self.ends[keep - 1] if keep > 0 else 0
        del self.ids[keep:], self.ends[keep:]
        for t, end in self._spell(complete_utf8(self.committed[start:]), start):
            self.ids.append(t)
            self.ends.append(end)
        self._checked = len(self.ids)
        return self.ids

    def preview(self, target_ids: list[int]) -> list[int]:
        """The drafter's context if `target_ids` were committed next (nothing is committed)."""
        state = self.committed, list(self.ids), list(self.ends), self._checked
        try:
            return list(self.commit(target_ids))
        finally:
            self.committed, self.ids, self.ends, self._checked = state

    def may_become(self, target_ids: list[int], contexts: Iterable[tuple[int, ...]]) -> bool:
        """Whether one of `contexts` (drafter ids) may be the drafter's context once `target_ids` are committed
        next, judged by the bytes of each one's last ENDING_TOKENS tokens against the end of the text then,
        without re-tokenising it (`commit` and `preview` take about 0.25 ms a round after a verifier pass).
        False only where none is: a context spells the template's text and then the committed text, so where
        its last tokens spell no more bytes than the committed text has, they spell that text's end. (Unless
        the text has characters the drafter cannot spell, left out of its context: then it answers True.)"""
        text = complete_utf8(self.committed + b"".join(self.target_bytes[t] or b"" for t in target_ids))
        if len(text.translate(None, self.unspellable)) != len(text):
            return True
        for context in contexts:
            ending = b"".join(self.drafter_bytes[t] or b"" for t in context[-ENDING_TOKENS:])
            if len(ending) > len(text) or text.endswith(ending):
                return True
        return False

    def _spell(self, text: bytes, start: int) -> list[tuple[int, int]]:
        """Drafter ids for `text` (which begins at byte `start` of the committed text), each with the byte
        where it ends. Characters the drafter has no bytes for (a byte-level vocabulary may lack some) are
        left out, so the ends still line up with the committed text."""
        if len(text.translate(None, self.unspellable)) == len(text):
            runs = [(text.decode("utf-8"), start)]
        else:
            runs, at, run, run_start = [], start, "", start
            for ch in text.decode("utf-8"):
                raw = ch.encode("utf-8")
                if len(raw.translate(None, self.unspellable)) < len(raw):
                    runs.append((run, run_start))
                    run, run_start = "", at + len(raw)
                else:
                    run += ch
                at += len(raw)
            runs.append((run, run_start))
        out = []
        for run, at in runs:
            for t in self.tokenize(run) if run else []:
                at += len(self.drafter_bytes[t] or b"")
                out.append((t, at))
        return out

    def _inside_character(self, at: int) -> bool:
        return at < len(self.committed) and 0x80 <= self.committed[at] < 0xC0

    def _bytes_of(self, i: int) -> bytes:
        return self.drafter_bytes[self.ids[i]] or b""

    @property
    def pending(self) -> bool:
        """The committed text ends inside a character (a byte-fallback token split it): no text draft fits."""
        return complete_utf8(self.committed) != self.committed

    # --- SLEM -------------------------------------------------------------------------------------------
    def target_drafts(self, drafted: bytes) -> list[TargetDraft]:
        """The target's tokenisations of drafted text (whole characters only) after the committed text:
        standalone first, then in the context of the committed tail when that differs."""
        drafted = complete_utf8(drafted)
        if not drafted:
            return []
        text = drafted.decode("utf-8")
        out = [self._encode(text, "")]
        tail = complete_utf8(self.committed[-4 * LOOKBEHIND_CHARS :]).decode("utf-8", "ignore")[-LOOKBEHIND_CHARS:]
        if tail:
            in_context = self._encode(text, tail)
            if in_context is not None and in_context.ids and in_context.ids != out[0].ids:
                out.append(in_context)
        return [d for d in out if d is not None and d.ids]

    def _encode(self, text: str, before: str) -> TargetDraft | None:
        """`text` in target ids, tokenised after `before`; None where a token straddles the two, or where
        the ids do not spell the text byte for byte (a literal special token, a character the
        vocabulary drops)."""
        ids = self.target.encode(before + text, add_special_tokens=False)
        spelled = [self.target_bytes[t] or b"" for t in ids]
        if b"".join(spelled) != (before + text).encode("utf-8"):
            return None
        ends = np.cumsum([len(b) for b in spelled], dtype=np.int64).tolist()
        boundary = len(before.encode("utf-8"))
        first = next((i for i, end in enumerate(ends) if end > boundary), len(ids))
        if first < len(ids) and (ends[first - 1] if first else 0) < boundary:
            return None  # a token straddles the committed text: this tokenisation cannot follow it
        return TargetDraft(ids[first:], [end - boundary for end in ends[first:]])


END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


def end_map(drafter_ends: dict[int, str], target_ends: dict[int, str]) -> dict[int, int]:
    """The drafter's end tokens (id -> text) -> the target's: end of turn to end of turn where both have
    one, anything else to the target's first end token."""
    if not target_ends:
        return {}
    first = next(iter(target_ends))
    target_turn = next((t for t, text in target_ends.items() if text in END_OF_TURN), first)
    return {d: target_turn if text in END_OF_TURN else first for d, text in drafter_ends.items()}


def bridge_between(model, target: BpeTokenizer, target_ends: dict[int, str],
                   target_template: Render | None = None) -> SameVocab | CrossVocab:
    """SameVocab when every token of the drafter (a DraftModel) has the target's bytes under the same id,
    else CrossVocab. `target_ends`: the target's end-of-generation ids and their texts; `target_template`
    renders a conversation as the target's chat prompts are rendered."""
    from specedge.edge.token_bytes import token_bytes
    from specedge.edge.tokenizer import render_chat

    drafter_bytes = model.token_bytes()
    target_bytes = token_bytes(target)
    if len(drafter_bytes) <= len(target_bytes) and all(
            d is None or d == t for d, t in zip(drafter_bytes, target_bytes)):
        return SameVocab()
    drafter_ends = {t: model.token_text(t) for t in range(model.vocab_size) if model.is_end(t)}
    chat = None
    if target_template is not None and (template := model.chat_template) is not None:
        special = model.special_tokens
        chat = (target_template, lambda turns: render_chat(template, turns, special))
    return CrossVocab(drafter_bytes, target_bytes, target, model.tokenize, model.bos_id,
                      end_map(drafter_ends, target_ends), chat)
