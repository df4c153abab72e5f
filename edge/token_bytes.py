"""The true bytes of every token of a Hugging Face `tokenizer.json`: what the token adds to decoded text.

Vocabulary maps that compare token *strings* (rewriting only the leading-space sign, Ġ vs ▁) miss most of
a byte-level vocabulary: GPT-2 style tokenizers spell bytes as printable stand-ins (`Ċ` is a newline, `Ã©`
is "é"), and SentencePiece-style ones spell rare bytes as `<0xNN>`. Comparing bytes maps them all.

Special tokens (`<eos>`, `<|im_end|>`, ...) have no bytes: they are not text (None here).
"""

from __future__ import annotations

import re

from specedge.edge.bpe_tokenizer import BpeTokenizer
from specedge.edge.byte_level import char_bytes

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoders(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    return [d for inner in spec["decoders"] for d in _decoders(inner)] if spec["type"] == "Sequence" else [spec]


def token_bytes(tokenizer: BpeTokenizer) -> list[bytes | None]:
    """Bytes of each token id, None for special tokens and ids without a token."""
    decoders = _decoders(tokenizer.steps.get("decoder"))
    kinds = {d["type"] for d in decoders}
    unsupported = kinds - {"ByteLevel", "ByteFallback", "Replace", "Fuse"}
    if unsupported:  # e.g. Strip or Metaspace's prefix handling: token bytes would depend on position
        raise ValueError(f"cannot tell token bytes for a tokenizer with decoders {sorted(unsupported)}")
    replaces = [(d["pattern"]["String"], d["content"]) for d in decoders if d["type"] == "Replace"]
    byte_level = char_bytes() if "ByteLevel" in kinds else None
    byte_fallback = "ByteFallback" in kinds
    added = tokenizer.added
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i)
        if i in added:
            out.append(None if added[i].special else added[i].content.encode("utf-8"))
        elif piece is None:
            out.append(None)
        elif byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            out.append(bytes([int(m.group(1), 16)]))
        elif byte_level is not None:
            out.append(bytes(byte_level[c] for c in piece) if all(c in byte_level for c in piece) else None)
        else:
            for before, after in replaces:
                piece = piece.replace(before, after)
            out.append(piece.encode("utf-8"))
    return out
