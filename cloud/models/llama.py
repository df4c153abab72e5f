"""Llama-family forward pass (SmolLM2 and friends) over the paged KV pool, using a transformers model's weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specedge.cloud.attention import StepBatch, apply_rope, paged_attention, rope_cos_sin
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.linear import Linear, linear
from specedge.cloud.models.compiled import LayerParts
from specedge.cloud.output_layer import OutputLayer


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
        self.lm_head = OutputLayer(hf_model.lm_head.weight)
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
        self.parts = LayerParts(attention_inputs, mlp_residual)

    def compile(self) -> None:
        """Run each layer's dense parts (norms, projections, RoPE, SwiGLU, residuals) through `torch.compile`,
        which fuses their elementwise kernels; attention and the KV pool's writes stay as they are. Meant for
        CUDA, where a small pass is dozens of tiny kernels per layer (BENCHMARKS.md section 9); on the CPU the
        oneDNN-packed weights are used and nothing is compiled (`parts.compiled` says which)."""
        if not self.lm_head.packed:
            self.parts.compile()

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: KVBlockPool, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run the new tokens of `batch`; return logits [len(logits_rows), V] for the selected rows."""
        return self.lm_head.logits(self.hidden(batch, pool, logits_rows))

    @torch.inference_mode()
    def hidden(self, batch: StepBatch, pool: KVBlockPool, rows: torch.Tensor) -> torch.Tensor:
        """Run the new tokens of `batch`; return the final (normed) hidden states [len(rows), D] of `rows`, what
        the output layer (`lm_head`) takes."""
        x = F.embedding(batch.input_ids, self.embed)
        cos, sin = rope_cos_sin(batch.positions, self.head_dim, self.rope_base, x.dtype)
        parts, w = self.parts, self.parts.weight
        for i, layer in enumerate(self.layers):
            q, k, v = parts.attention_inputs(x, layer.attn_norm, w(layer.wqkv), cos, sin, self.eps, self.num_heads,
                                             self.num_kv_heads, self.head_dim)
            attn = paged_attention(q, k, v, i, pool, batch, self.scale)
            x = parts.mlp_residual(x, attn, w(layer.wo), layer.mlp_norm, w(layer.w_gate_up), w(layer.w_down),
                                   self.eps)
        return rms_norm(x[rows], self.norm, self.eps)


def attention_inputs(x: torch.Tensor, norm: torch.Tensor, wqkv: Linear | torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries, keys and values for x [T, hidden]: normed, projected, RoPE applied to q and k."""
    h = rms_norm(x, norm, eps)
    q, k, v = linear(h, wqkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(-1, heads, head_dim), cos, sin)
    k = apply_rope(k.view(-1, kv_heads, head_dim), cos, sin)
    return q, k, v.view(-1, kv_heads, head_dim)


def mlp_residual(x: torch.Tensor, attn: torch.Tensor, wo: Linear | torch.Tensor, norm: torch.Tensor,
                 w_gate_up: Linear | torch.Tensor, w_down: Linear | torch.Tensor, eps: float) -> torch.Tensor:
    """The rest of a layer after attention: output projection and residual, then the SwiGLU MLP and residual."""
    x = x + linear(attn, wo)
    gate, up = linear(rms_norm(x, norm, eps), w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)
