"""Llama-family forward pass (SmolLM2 and friends) over the paged KV pool, using a transformers model's weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specedge.cloud.attention import StepBatch, apply_rope, paged_attention, rope_cos_sin
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.linear import Linear


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor
    wqkv: Linear  # q, k and v projections fused: one matmul instead of three (fewer, larger GEMMs on CPU)
    wo: Linear
    mlp_norm: torch.Tensor
    w_gate_up: Linear  # gate and up projections fused
    w_down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 whatever x's dtype, then scaled in x's dtype, as transformers computes it (the casts
    are no-ops in fp32). `F.rms_norm` is one fused kernel on a GPU where the formula spelled out is five
    (BENCHMARKS.md section 9, run 7) and gives the same bits on the CPU."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class LlamaRunner:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        if (cfg.rope_parameters or {}).get("rope_type", "default") != "default":
            raise NotImplementedError(f"RoPE scaling {cfg.rope_parameters} is not supported yet")
        if cfg.hidden_act != "silu" or cfg.attention_bias or getattr(cfg, "mlp_bias", False):
            raise NotImplementedError("only bias-free SiLU Llama models are supported")
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.rope_base = cfg.rope_parameters["rope_theta"]
        self.scale = self.head_dim**-0.5
        m = hf_model.model
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = Linear(hf_model.lm_head.weight)
        self.layers = [
            LlamaLayer(
                attn_norm=l.input_layernorm.weight,
                wqkv=Linear(torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                                       l.self_attn.v_proj.weight])),
                wo=Linear(l.self_attn.o_proj.weight),
                mlp_norm=l.post_attention_layernorm.weight,
                w_gate_up=Linear(torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight])),
                w_down=Linear(l.mlp.down_proj.weight),
            )
            for l in m.layers
        ]

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: KVBlockPool, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run the new tokens of `batch`; return logits [len(logits_rows), V] for the selected rows."""
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = rope_cos_sin(batch.positions, self.head_dim, self.rope_base, x.dtype)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, self.eps)
            q, k, v = layer.wqkv(h).split([nq, nkv, nkv], dim=-1)
            q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            x = x + layer.wo(paged_attention(q, k, v, i, pool, batch, self.scale))
            h = rms_norm(x, layer.mlp_norm, self.eps)
            gate, up = layer.w_gate_up(h).chunk(2, dim=-1)
            x = x + layer.w_down(F.silu(gate) * up)
        x = rms_norm(x[logits_rows], self.norm, self.eps)
        return self.lm_head(x)
