"""The model registry's cache: built once, verified on every use, rebuilt when partial or corrupt."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from specedge.cloud import model_registry as reg
from specedge.cloud.model_registry import MANIFEST, ModelSource, cache_root, load_model, resolve_model_dir


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def build_tiny_llama(out_dir: Path) -> None:
    """A test-only 'conversion': a tiny random LlamaForCausalLM plus a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out_dir)


@pytest.fixture
def tiny(monkeypatch) -> dict:
    """Registers 'tiny' (builds counted in the returned dict) and collects log messages."""
    state = {"builds": 0, "log": []}

    def build(out_dir: Path) -> None:
        state["builds"] += 1
        build_tiny_llama(out_dir)

    monkeypatch.setitem(reg.MODELS, "tiny", ModelSource("tiny", "test-only tiny llama", build, "~0 s"))
    return state


def resolve(state: dict) -> Path:
    return resolve_model_dir("tiny", log=state["log"].append)


def test_cache_root_reads_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "b"
    monkeypatch.delenv("SPECEDGE_CACHE")
    assert cache_root().name == "specedge"


def test_first_use_builds_an_entry_with_a_manifest_and_later_uses_reuse_it(cache, tiny):
    entry = resolve(tiny)
    assert entry == cache / "models" / "tiny"
    assert tiny["builds"] == 1 and len(tiny["log"]) == 1
    assert tiny["log"][0].startswith("converting tiny") and str(entry) in tiny["log"][0]
    files = json.loads((entry / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert set(files) == {p.name for p in entry.iterdir()} - {MANIFEST}
    for name, rec in files.items():
        assert rec["size"] == (entry / name).stat().st_size
        assert rec["sha256"] == reg._sha256(entry / name)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny", "tiny.lock"]  # no temp dirs left

    assert resolve(tiny) == entry
    assert tiny["builds"] == 1 and len(tiny["log"]) == 1  # silent, no rebuild


def test_load_model_gives_an_eval_model_and_its_tokenizer(cache, tiny):
    model, tokenizer = load_model("tiny")
    assert not model.training and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 2 and model.generation_config.eos_token_id == 2
    ids = tokenizer("w5 w6 w7", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 6, 7]]
    again, _ = load_model(str(cache / "models" / "tiny"))  # a local HF dir loads as is
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert load_model("tiny", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def _truncate(entry: Path) -> None:
    with open(entry / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 1)


def _flip_byte(entry: Path) -> None:
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)  # same size, new mtime: caught by the hash


def _drop_manifest(entry: Path) -> None:
    (entry / MANIFEST).unlink()


def _garble_manifest(entry: Path) -> None:
    (entry / MANIFEST).write_text('{"files": ')


def _drop_file(entry: Path) -> None:
    (entry / "tokenizer.json").unlink()


def _add_file(entry: Path) -> None:
    (entry / "stray.bin").write_bytes(b"x")


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "model.safetensors: size"),
    (_flip_byte, "model.safetensors: sha256 mismatch"),
    (_drop_manifest, "no manifest"),
    (_garble_manifest, "unreadable manifest"),
    (_drop_file, "missing tokenizer.json"),
    (_add_file, "unexpected stray.bin"),
])
def test_a_damaged_entry_is_logged_and_rebuilt(cache, tiny, damage, reason):
    entry = resolve(tiny)
    damage(entry)
    assert resolve(tiny) == entry
    assert tiny["builds"] == 2
    assert tiny["log"][1].startswith(f"cache entry {entry} is corrupt ({reason}")
    assert tiny["log"][1].endswith("); rebuilding") and tiny["log"][2].startswith("converting tiny")
    assert reg._check_manifest(entry) is None
    load_model("tiny")


def test_a_touched_but_intact_file_is_rehashed_and_still_trusted(cache, tiny):
    entry = resolve(tiny)
    os.utime(entry / "model.safetensors", ns=(10**9, 10**9))  # mtime differs from the manifest: hash it
    assert reg._check_manifest(entry) is None
    resolve(tiny)
    assert tiny["builds"] == 1 and len(tiny["log"]) == 1


def test_a_leftover_temp_dir_from_an_interrupted_build_is_removed(cache, tiny):
    leftover = cache / "models" / ".tiny.tmp-interrupted"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{")
    entry = resolve(tiny)
    assert not leftover.exists() and tiny["builds"] == 1
    assert reg._check_manifest(entry) is None


def test_a_failing_build_leaves_nothing_behind(cache, tiny, monkeypatch):
    def broken(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setitem(reg.MODELS, "tiny", ModelSource("tiny", "broken", broken))
    with pytest.raises(RuntimeError, match="conversion failed"):
        resolve(tiny)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny.lock"]


def _slow_build(out_dir: Path) -> None:
    """No torch (safe in forked children); slow enough for the racers to overlap; counts builds on disk."""
    with open(out_dir.parent.parent / "builds.txt", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    (out_dir / "config.json").write_text('{"model_type": "llama"}')
    (out_dir / "weights.bin").write_bytes(os.urandom(1 << 16))


def _race(_):
    return str(resolve_model_dir("slow", log=lambda msg: None))


def test_concurrent_first_uses_build_once(cache, monkeypatch):
    monkeypatch.setitem(reg.MODELS, "slow", ModelSource("slow", "test-only", _slow_build))
    with multiprocessing.get_context("fork").Pool(3) as pool:  # children inherit the patched registry
        results = pool.map(_race, range(3))
    entry = cache / "models" / "slow"
    assert results == [str(entry)] * 3
    assert len((cache / "builds.txt").read_text().split()) == 1
    assert reg._check_manifest(entry) is None


def test_names_paths_and_unknown_names(cache, tmp_path):
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model_dir(str(local)) == local
    for bad in ["no-such-model", str(tmp_path)]:  # unknown name; a dir without config.json
        with pytest.raises(ValueError, match="smollm2-135m") as err:
            resolve_model_dir(bad)
        assert "gemma3-270m" in str(err.value) and bad in str(err.value)
    assert not (cache / "models").exists()  # nothing converted


@pytest.mark.real_model
def test_smollm2_converts_once_then_loads_fast_and_identically(cache):
    t0 = time.perf_counter()
    first, tokenizer = load_model("smollm2-135m")
    convert_s = time.perf_counter() - t0
    entry = cache / "models" / "smollm2-135m"
    names = {p.name for p in entry.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", MANIFEST} == names
    assert (entry / "model.safetensors").stat().st_size > 500e6  # dequantised fp32

    t0 = time.perf_counter()
    second, tokenizer2 = load_model("smollm2-135m")
    load_s = time.perf_counter() - t0
    print(f"smollm2-135m: convert+load {convert_s:.1f} s, cached load {load_s:.2f} s")
    assert load_s < 10

    assert second.config.model_type == "llama" and second.config.num_hidden_layers == 30
    assert second.generation_config.eos_token_id == 2 == tokenizer2.eos_token_id  # <|im_end|>
    assert tokenizer2.eos_token == "<|im_end|>" and tokenizer2.chat_template == tokenizer.chat_template
    prompt = tokenizer2.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer2("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == tokenizer("The capital of France is", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = first(ids).logits, second(ids).logits
    assert torch.equal(a, b)
    assert tokenizer2.decode(a[0, -1].argmax()) == " Paris"

    with pytest.raises(ValueError, match="smollm2-135m.*gemma3-270m|gemma3-270m.*smollm2-135m"):
        resolve_model_dir("smollm2-999m")
