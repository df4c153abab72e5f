"""The target model's tokenizer as files an edge can carry without the model, and the fingerprint by which
edge and verifier agree on token ids.

A verifier serves its tokenizer as a TokenizerBundle (GetTokenizer RPC); the edge rebuilds it with the
`tokenizers` library (edge/tokenizer.py) and keeps it on disk under its fingerprint (edge/tokenizer_cache.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def tokenizer_fingerprint(vocab: dict[str, int], special_tokens: dict[str, str]) -> str:
    """A short hash of what decides token ids and their meaning: every token with its id (added tokens
    included) and the named special tokens (bos, eos, ...). Both sides compute it from what they hold: a
    transformers tokenizer on the verifier, the `tokenizers` library on the edge."""
    payload = json.dumps({"vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
                          "special": sorted(special_tokens.items())}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TokenizerBundle:
    tokenizer_json: bytes  # the `tokenizers` library's serialisation, as transformers runs it
    chat_template: str | None
    special_tokens: dict[str, str]  # transformers' `special_tokens_map`: what chat templates see by name
    clean_up_spaces: bool = False  # decoding removes spaces before punctuation (transformers' clean-up)

    @classmethod
    def of_transformers(cls, tokenizer) -> TokenizerBundle:
        """The bundle of a transformers (fast) tokenizer: what it runs, not what its files say."""
        return cls(tokenizer.backend_tokenizer.to_str().encode(), tokenizer.chat_template,
                   dict(tokenizer.special_tokens_map), transformers_clean_up(tokenizer))


def transformers_clean_up(tokenizer) -> bool:
    """Whether a transformers tokenizer's `decode` cleans up spaces: it skips that for BPE models (where it
    would delete real spaces before punctuation)."""
    return bool(tokenizer.clean_up_tokenization_spaces) and type(tokenizer.backend_tokenizer.model).__name__ != "BPE"
