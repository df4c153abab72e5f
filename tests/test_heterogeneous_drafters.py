"""Clients with different drafters on one verifier over gRPC (gemma3-270m target): retrieval, the
smollm2-135m model across vocabularies (SLEM), gemma3-270m's own quantised GGUF (same vocabulary) and the
hybrid, all at once. Each gets exactly transformers' greedy output, and their trees share engine steps."""

from __future__ import annotations

import threading

import pytest
from transformers_greedy import transformers_greedy

from specedge.bench import specbench
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.cloud.model_registry import eos_token_ids
from specedge.edge.client import EdgeClient

pytestmark = pytest.mark.real_model
MODEL = "gemma3-270m"
DRAFTERS = ["retrieval", "model:smollm2-135m", "model:gemma3-270m", "hybrid:smollm2-135m"]
NEW_TOKENS = 24


def test_clients_with_different_drafters_share_a_verifier_and_each_get_the_target_output(real_model):
    hf, tokenizer = real_model(MODEL)
    prompts = [p.text[:600] for p in specbench.stratified(specbench.load(), 2 * len(DRAFTERS))]
    expected = transformers_greedy(hf, [tokenizer(text)["input_ids"] for text in prompts], NEW_TOKENS,
                                   eos_token_ids(hf))
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with EmbeddedVerifier(ServerConfig(model=MODEL, port=0, kv_pool_mb=256), (hf, tokenizer)) as verifier:
        steps = verifier.service.metrics.batch_sessions

        def run(k: int) -> None:
            try:
                client = EdgeClient(verifier.target, drafter=DRAFTERS[k], tokenizer=tokenizer)
                for i in range(k, len(prompts), len(DRAFTERS)):
                    results[i] = client.generate(prompts[i], max_new_tokens=NEW_TOKENS).token_ids
                client.close()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(DRAFTERS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        shared = {s.labels["le"]: s.value for m in steps.collect() for s in m.samples if s.name.endswith("_bucket")}
        assert shared["+Inf"] > shared["1.0"]  # engine steps with several sessions' trees happened
        assert verifier.used_blocks() == 0
    for i, want in enumerate(expected):
        assert results[i] == want, f"{DRAFTERS[i % len(DRAFTERS)]} on prompt {i}"
