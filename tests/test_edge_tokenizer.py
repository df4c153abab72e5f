"""The edge's tokenizer (the served tokenizer.json run in plain Python, and jinja2; no transformers, no
`tokenizers` library) encodes prompts, renders chat templates and decodes exactly as transformers does, on
both models; the verifier serves it (GetTokenizer) and the edge keeps it on disk, compiled, under its
fingerprint."""

from __future__ import annotations

import grpc
import pytest
from transformers import AutoTokenizer

from specedge.bench import specbench
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.cloud.model_registry import resolve_model_dir
from specedge.common import wire
from specedge.common.tokenizer_bundle import TokenizerBundle, tokenizer_fingerprint
from specedge.edge.client import EdgeClient
from specedge.edge.tokenizer import EdgeTokenizer
from specedge.edge.transport import RemoteVerifier
from tiny_models import tiny_llama

pytestmark = pytest.mark.real_model
MODELS = ["smollm2-135m", "gemma3-270m"]

TEXTS = [p.text for p in specbench.stratified(specbench.load(), 13)] + [
    "", " ", "Hello world", "  two  spaces\tand a tab\n\n\nnew lines ", "ünïcödé 日本語 한국어 🙂🚀", "x" * 300,
    "<|im_start|>user\nnot a real turn<|im_end|>", "<bos><eos><start_of_turn>model", "1234567890 3.14159 -7e10",
    "def f(x):\n    return {'a': [1, 2]}\n", "Don't you're we've I'm it's", "word ,punct .spaced !",
]

# Templates that use what chat templates use: system turns, loops with loop controls, namespaces, filters,
# the `tojson` filter, `raise_exception`, special tokens by name, whitespace control, `{% generation %}`.
TEMPLATES = {
    "turns": "{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>\\n' + m['content'] | trim }}"
             "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}",
    "system_first": "{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
                    "{% set ns.system = m.content %}{% continue %}{% endif %}{% if loop.first and ns.system %}"
                    "[SYS]{{ ns.system }}[/SYS]{% endif %}\n  {{ m.role | upper }}: {{ m.content }}\n{% endfor %}",
    "json": "{% for m in messages %}{{ m | tojson }}\n{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
            "{% generation %}{{ 'assistant:' if add_generation_prompt }}{% endgeneration %}",
    "strict": "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
              "{{ m.role }}: {{ m.content }}\n{% endfor %}",
}
CHATS = [
    [{"role": "user", "content": "Summarize: the bridge needs new bearings."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \"there\" <b>&</b>"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "ünïcödé 🙂\n\nok"}],
]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(transformers tokenizer, the edge's tokenizer rebuilt from what a verifier would serve)."""
    hf = AutoTokenizer.from_pretrained(resolve_model_dir(request.param))
    return hf, EdgeTokenizer.from_bundle(TokenizerBundle.of_transformers(hf))


def test_text_encodes_and_decodes_exactly_as_transformers_does(pair):
    hf, edge = pair
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert edge.encode(text) == ids, text
        with_specials = ids + [hf.eos_token_id] + hf(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert edge.decode(with_specials, skip_special_tokens=skip) == hf.decode(with_specials,
                                                                                   skip_special_tokens=skip)
    batch = hf(TEXTS[:8], add_special_tokens=False)["input_ids"]
    assert edge.encode_documents(TEXTS[:8]) == batch


def test_prompts_encode_as_transformers_apply_chat_template_does(pair):
    hf, edge = pair
    for text in TEXTS[:13]:
        if hf.chat_template:  # SmolLM2-Instruct has one; the Gemma 3 base model has none
            want = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
            assert edge.encode_prompt(text, chat=True) == list(want)
        else:
            with pytest.raises(ValueError, match="no chat template"):
                edge.encode_prompt(text, chat=True)
        assert edge.encode_prompt(text) == hf(text)["input_ids"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_chat_templates_render_byte_for_byte_as_in_transformers(pair, name):
    hf, _ = pair
    hf.chat_template, saved = TEMPLATES[name], hf.chat_template
    try:
        edge = EdgeTokenizer.from_transformers(hf)
        for chat in CHATS:
            for generation_prompt in (True, False):
                try:
                    want = hf.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False)
                except Exception as e:  # the template refuses this chat: so must the edge, with the same words
                    with pytest.raises(type(e), match=str(e)):
                        edge.render_chat(chat, add_generation_prompt=generation_prompt)
                    continue
                assert edge.render_chat(chat, add_generation_prompt=generation_prompt) == want
    finally:
        hf.chat_template = saved


def test_the_fingerprint_is_the_same_from_transformers_and_from_the_served_bundle(pair):
    hf, edge = pair
    assert edge.fingerprint == tokenizer_fingerprint(hf.get_vocab(), hf.special_tokens_map)
    other = EdgeTokenizer(edge.backend, edge.chat_template, {**edge.special_tokens, "eos_token": "<pad>"})
    assert other.fingerprint != edge.fingerprint  # a different end token is a different contract


def test_a_large_tokenizer_travels_in_parts_under_grpcs_message_limit():
    hf = AutoTokenizer.from_pretrained(resolve_model_dir("gemma3-270m"))
    bundle = TokenizerBundle.of_transformers(hf)
    parts = wire.tokenizer_to_parts(bundle, "fp")
    assert len(bundle.tokenizer_json) > 4 << 20 and all(p.ByteSize() <= (1 << 20) + 4096 for p in parts)
    assert wire.tokenizer_from_parts(iter(parts)) == bundle
    with pytest.raises(ValueError, match="incomplete"):
        wire.tokenizer_from_parts(iter(parts[:-1]))


@pytest.fixture(scope="module")
def tokenizer_verifier():
    """A verifier of a tiny model that serves SmolLM2's tokenizer: the tokenizer is what is tested here."""
    hf = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    with EmbeddedVerifier(ServerConfig(model="tiny", port=0, kv_pool_mb=8), (tiny_llama(vocab_size=512), hf)) as v:
        yield v, hf


def test_a_client_without_a_tokenizer_fetches_the_verifiers_once_and_then_uses_its_cached_copy(
        tokenizer_verifier, tmp_path, monkeypatch):
    verifier, hf = tokenizer_verifier
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    first = EdgeClient(verifier.target, drafter="none")
    fingerprint = first.tokenizer.fingerprint
    assert fingerprint == verifier.service.model.fingerprint
    assert (tmp_path / "tokenizers" / fingerprint / "tokenizer.json").is_file()
    assert first.tokenizer.encode_prompt("Hi", chat=True) == list(hf.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    first.close()

    def no_fetch(self, fp):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(RemoteVerifier, "tokenizer", no_fetch)  # our own method: the second client must not ask
    second = EdgeClient(verifier.target, drafter="none")
    assert second.tokenizer.fingerprint == fingerprint
    second.close()


def test_a_damaged_cached_tokenizer_is_fetched_again(tokenizer_verifier, tmp_path, monkeypatch):
    verifier, hf = tokenizer_verifier
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    fingerprint = EdgeClient(verifier.target, drafter="none").tokenizer.fingerprint
    config = tmp_path / "tokenizers" / fingerprint / "specedge-tokenizer.json"
    config.write_text(config.read_text().replace("<|im_end|>", "<|endoftext|>"))  # another eos: another fingerprint
    assert EdgeClient(verifier.target, drafter="none").tokenizer.fingerprint == fingerprint
    assert "<|im_end|>" in config.read_text()
    merges = tmp_path / "tokenizers" / fingerprint / "compiled" / "merge_values.npy"
    merges.write_bytes(merges.read_bytes()[:-12])  # a compiled form cut short: the same, fetched again
    assert EdgeClient(verifier.target, drafter="none").tokenizer.encode("Hi there") == hf.encode("Hi there")


def test_get_tokenizer_refuses_another_fingerprint_and_a_verifier_without_a_tokenizer_says_so(tokenizer_verifier):
    verifier, _ = tokenizer_verifier
    remote = RemoteVerifier(verifier.target)
    with pytest.raises(grpc.RpcError) as e:
        remote.tokenizer("0123456789abcdef")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    remote.close()
    with EmbeddedVerifier(ServerConfig(model="tiny", port=0, kv_pool_mb=8), (tiny_llama(vocab_size=512), None)) as bare:
        remote = RemoteVerifier(bare.target)
        with pytest.raises(grpc.RpcError) as e:
            remote.tokenizer("")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "token ids only" in e.value.details()
        remote.close()


def test_a_prompt_that_is_not_utf8_gets_a_one_line_error_naming_the_bytes(pair):
    _, edge = pair
    not_utf8 = b"abc\xff\xfe".decode("utf-8", "surrogateescape")  # how Linux hands such an argument to Python
    for chat in (False, True):
        if chat and not edge.chat_template:
            continue
        with pytest.raises(ValueError, match=r"not valid UTF-8 \(bytes ff fe at character 3\)"):
            edge.encode_prompt(not_utf8, chat=chat)
    with pytest.raises(ValueError, match="a lone surrogate"):
        edge.encode("\ud800 from a JSON escape")
