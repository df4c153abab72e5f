"""Text <-> token ids the way transformers does it: prompt encoding, EOS ids, stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`: the tokenizer's default encoding, or the chat template with a user turn."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; run without --chat")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return list(ids)


def eos_token_ids(hf_model) -> list[int]:
    """The ids on which transformers' `generate` stops for this model (its generation config)."""
    eos = hf_model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def stop_at_strings(tokenizer, stops: Sequence[str]) -> Callable[[list[int]], int | None]:
    """A stop check: the number of tokens to keep once the decoded output contains a stop string."""

    def check(output_ids: list[int]) -> int | None:
        if not any(s in tokenizer.decode(output_ids) for s in stops):
            return None
        # Keep the shortest prefix that already contains a stop string (the text is cut before it later).
        for n in range(1, len(output_ids) + 1):
            if any(s in tokenizer.decode(output_ids[:n]) for s in stops):
                return n
        return len(output_ids)

    return check


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides token ids: the vocabulary with its ids and the special tokens.

    Edge and verifier compare fingerprints before trusting each other's token ids.
    """
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps({"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens)),
                          "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
