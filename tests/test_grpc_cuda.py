"""The verifier on a CUDA GPU behind real gRPC on 127.0.0.1 (tiny model, float32): several clients at once,
with drafts right and wrong and with hints, get exactly transformers' greedy output, and give back every KV
block. The engine's own CUDA tests (test_engine_*.py) drive the engine directly; these drive the served
stack (scheduler, gathering of steps, the wire). Run where a GPU is visible; skipped in CI, which has none."""

from __future__ import annotations

import threading

import pytest
import torch

from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.transport import RemoteVerifier
from tiny_models import tiny_llama

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible: runs on a GPU machine")]

V = 512
NEW_TOKENS = 24


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def drafts_of(reference: list[int], depth: int, wrong_every: int) -> FunctionDrafter:
    """Chains of the true continuation, every `wrong_every`-th round a chain of wrong tokens instead."""
    rounds = [0]

    def draft(committed: list[int]) -> DraftTree:
        rounds[0] += 1
        n = len(committed)
        if rounds[0] % wrong_every and committed == reference[:n] and n < len(reference):
            return DraftTree.chain(reference[n : n + depth])
        return DraftTree.chain([(committed[-1] + 1) % V, (committed[-1] + 2) % V])

    return FunctionDrafter(draft)


def test_concurrent_clients_of_a_gpu_verifier_get_transformers_greedy_output():
    hf = tiny_llama(vocab_size=V)
    hf.generation_config.eos_token_id = None  # every session runs its full length
    prompts = [[(5 * i + 3 * j) % (V - 3) + 3 for j in range(10 + 3 * i)] for i in range(6)]
    want = [hf_greedy(hf, p) for p in prompts]  # on the CPU, before the verifier moves the model to the GPU
    config = ServerConfig(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, max_new_tokens=256,
                          gather_ms=2.0, device="cuda", dtype="float32")
    with EmbeddedVerifier(config, (hf, None)) as server:
        assert server.engine.device.type == "cuda"
        got = [None] * len(prompts)

        def client(i: int) -> None:
            session = RemoteVerifier(server.target).open(
                prompts[i], SamplingParams(max_new_tokens=NEW_TOKENS), hints_top_k=4 * (i % 2))
            drafter = None if i == 0 else drafts_of(prompts[i] + want[i], depth=1 + i, wrong_every=2 + i % 3)
            got[i] = generate(session, drafter=drafter)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.token_ids for r in got] == want
        assert all(r.rounds < NEW_TOKENS for r in got[1:])  # drafts were accepted on the GPU
        assert server.used_blocks() == 0
