"""Tiny randomly initialised models of the supported architectures, for fast tests."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM


# Tests that take a `device` parameter run on the CPU everywhere and on CUDA where a GPU is visible.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU visible: runs on a GPU machine")]),
]


def tiny_llama(vocab_size: int = 512, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=1, bos_token_id=0,
    )
    return _init(LlamaForCausalLM(config))


def tiny_gemma3(vocab_size: int = 512, sliding_window: int = 8, seed: int = 0) -> Gemma3ForCausalLM:
    """Gemma 3 with a short sliding window so tests cross the window boundary cheaply."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=sliding_window, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=2048, eos_token_id=1, bos_token_id=2, pad_token_id=0,
    )
    return _init(Gemma3ForCausalLM(config))


def _init(model: torch.nn.Module) -> torch.nn.Module:
    # Default init leaves norms at identity and logits nearly flat; larger random weights give the peaked,
    # position-dependent distributions that make parity and acceptance tests meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.config._attn_implementation = "sdpa"
    return model.eval()
