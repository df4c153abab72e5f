"""The target model's tokenizer on the edge, without transformers or the `tokenizers` library: the
verifier's tokenizer.json run in plain Python (edge/bpe_tokenizer.py) turns text into token ids and back,
and jinja2 renders the chat template the way transformers' `apply_chat_template` does (same sandbox,
options, filters and globals), so prompts encode to the same ids byte for byte
(tests/test_edge_tokenizer.py checks both models against transformers)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache

from specedge.common.tokenizer_bundle import TokenizerBundle, tokenizer_fingerprint, transformers_clean_up
from specedge.edge.bpe_tokenizer import BpeTokenizer


class EdgeTokenizer:
    def __init__(self, backend: BpeTokenizer, chat_template: str | None, special_tokens: dict[str, str],
                 clean_up_spaces: bool = False, fingerprint: str | None = None) -> None:
        """`fingerprint`: where it is already known to be this tokenizer's (the edge cache checked it when
        the tokenizer was fetched); else computed when first asked (for Gemma 3: ~0.5 s and ~60 MB)."""
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.clean_up_spaces = clean_up_spaces
        if fingerprint is not None:
            self.__dict__["fingerprint"] = fingerprint  # the cached_property's value

    @classmethod
    def from_bundle(cls, bundle: TokenizerBundle) -> EdgeTokenizer:
        return cls(BpeTokenizer.from_json(bundle.tokenizer_json), bundle.chat_template, bundle.special_tokens,
                   bundle.clean_up_spaces)

    @classmethod
    def from_transformers(cls, tokenizer) -> EdgeTokenizer:
        """From a transformers (fast) tokenizer already in memory, e.g. the verifier's own: what it runs."""
        return cls(_bpe_of(tokenizer.backend_tokenizer.to_str()), tokenizer.chat_template,
                   tokenizer.special_tokens_map, transformers_clean_up(tokenizer))

    @cached_property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.backend.get_vocab(), self.special_tokens)

    def token_id(self, name: str) -> int | None:
        """The id of a named special token ("eos_token", ...), None if the tokenizer has none."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with the tokenizer's own special tokens (e.g. BOS), as `tokenizer(text)`."""
        return self.backend.encode(checked_text(text))

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts, without special tokens (the long-term datastore's documents)."""
        return self.backend.encode_batch(texts, add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; run without --chat")
        return render_chat(self.chat_template, messages, self.special_tokens, add_generation_prompt)

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt`: the default encoding, or the chat template with one user turn."""
        return self.encode_chat([{"role": "user", "content": prompt}]) if chat else self.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation in the chat template, ready for the assistant's turn (the template
        writes the special tokens itself)."""
        for m in messages:
            if isinstance(m.get("content"), str):
                checked_text(m["content"])
        return self.backend.encode(checked_text(self.render_chat(messages)), add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text


@lru_cache(maxsize=4)
def _bpe_of(tokenizer_json: str) -> BpeTokenizer:
    """Read once per process: Gemma 3's JSON takes ~1.5 s (tests and benchmarks make many clients)."""
    return BpeTokenizer.from_json(tokenizer_json)


def stop_at_strings(tokenizer: EdgeTokenizer, stops: Sequence[str]) -> Callable[[list[int]], int | None]:
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


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str],
                add_generation_prompt: bool = True) -> str:
    """`messages` rendered by a chat template (jinja), as transformers' `apply_chat_template` renders them."""
    return _compiled(template).render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                      add_generation_prompt=add_generation_prompt, **special_tokens)


@lru_cache(maxsize=8)
def _compiled(template: str):
    return _jinja_environment().from_string(template)


def _jinja_environment():
    """The environment transformers renders chat templates in: a sandbox that cannot change its inputs,
    trimmed blocks, loop controls, a `tojson` that does not escape HTML, and the same globals."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
        it is rendering its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _clean_up(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def checked_text(text: str) -> str:
    """`text`, if it is text: a command-line argument with bytes that are not UTF-8 arrives with them as lone
    surrogates (and JSON may carry them as escapes), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            bad = text[e.start : e.end].encode("utf-8", "surrogateescape")
            what = ("byte " if len(bad) == 1 else "bytes ") + bad.hex(" ")
        except UnicodeEncodeError:
            what = "a lone surrogate"
        raise ValueError(f"the prompt is not valid UTF-8 ({what} at character {e.start})") from None
    return text
