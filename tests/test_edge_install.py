"""`pip install specedge[edge]` alone, in a fresh venv, gives a client that generates against a verifier on
loopback (its output is the model's own greedy output) without torch, transformers, the `tokenizers`
library or the verifier's code in its process, and without the model: the tokenizer comes from the
verifier."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from specedge.bench.edge_venv import CLIENT_SCRIPT, build_edge_venv, installed_packages
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"
PROMPT = "Summarize: The committee approved the north span repairs and asked for a south span estimate."


def test_the_edge_alone_installs_without_torch_and_generates_the_models_own_output(tmp_path, real_model):
    python = build_edge_venv(tmp_path, log=lambda msg: None)
    installed = installed_packages(python)
    assert "specedge" in installed
    assert not {"torch", "transformers", "accelerate", "gguf", "safetensors", "tokenizers", "huggingface_hub",
                "huggingface-hub", "pydivsufsort"} & set(installed)
    hf, tokenizer = real_model(MODEL)
    with EmbeddedVerifier(ServerConfig(model=MODEL, port=0, kv_pool_mb=64), (hf, tokenizer)) as verifier:
        env = {**os.environ, "SPECEDGE_CACHE": str(tmp_path / "edge-cache")}  # nothing cached: it must fetch
        run = subprocess.run([str(python), "-c", CLIENT_SCRIPT, verifier.target, PROMPT, "24"], env=env,
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["heavy_modules"] == []
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24)[0, x.shape[1]:]
    assert out["token_ids"] == want.tolist()
    assert out["text"] == tokenizer.decode(want, skip_special_tokens=True)
    without_verifier = subprocess.run([str(python.with_name("specedge")), "generate", "Hi"], env=env,
                                      capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert without_verifier.returncode != 0 and "give --server" in without_verifier.stderr
