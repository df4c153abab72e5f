"""Gemma 3 (text) forward pass over the paged KV pool, using a transformers model's weights.

Differences from Llama: embeddings scaled by sqrt(hidden), RMSNorm weights applied as (1 + w), norms
around both attention and MLP outputs ("sandwich"), RMSNorm on q and k per head, tanh-GELU MLP, and
two kinds of layers: sliding-window ones with their own RoPE base, and global ones.
"""

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
class Gemma3Layer:
    sliding: bool  # attends to a window of recent tokens (else to all)
    attn_norm: torch.Tensor  # each norm holds its 1 + weight in float32 (norm_scale)
    wqkv: Linear  # q, k and v projections fused
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wo: Linear
    post_attn_norm: torch.Tensor
    pre_mlp_norm: torch.Tensor
    w_gate_up: Linear  # gate and up projections fused
    w_down: Linear
    post_mlp_norm: torch.Tensor


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 whatever x's dtype, as transformers computes it (a no-op cast in fp32); `scale` is Gemma's
    1 + weight, in float32 (`norm_scale`). One fused kernel on a GPU (see llama.rms_norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def norm_scale(weight: torch.Tensor) -> torch.Tensor:
    return 1.0 + weight.float()


class Gemma3Runner:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        cfg = getattr(cfg, "text_config", cfg)
        for layer_type, rope in cfg.rope_parameters.items():
            if rope.get("rope_type", "default") != "default":
                raise NotImplementedError(f"RoPE scaling {rope} ({layer_type}) is not supported yet")
        if cfg.attn_logit_softcapping is not None or cfg.attention_bias:
            raise NotImplementedError("attention soft-capping and attention bias are not supported")
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.sliding_window = cfg.sliding_window
        self.rope_base = {t: r["rope_theta"] for t, r in cfg.rope_parameters.items()}
        m = hf_model.model
        self.embed = m.embed_tokens.weight
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.embed.dtype, device=self.embed.device)
        self.norm = norm_scale(m.norm.weight)
        self.lm_head = OutputLayer(hf_model.lm_head.weight, cfg.final_logit_softcapping)
        self.layers = []
        for i, l in enumerate(m.layers):
            a = l.self_attn
            self.layers.append(
                Gemma3Layer(
                    sliding=cfg.layer_types[i] == "sliding_attention",
                    attn_norm=norm_scale(l.input_layernorm.weight),
                    wqkv=Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                    q_norm=norm_scale(a.q_norm.weight),
                    k_norm=norm_scale(a.k_norm.weight),
                    wo=Linear(a.o_proj.weight),
                    post_attn_norm=norm_scale(l.post_attention_layernorm.weight),
                    pre_mlp_norm=norm_scale(l.pre_feedforward_layernorm.weight),
                    w_gate_up=Linear(torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight])),
                    w_down=Linear(l.mlp.down_proj.weight),
                    post_mlp_norm=norm_scale(l.post_feedforward_layernorm.weight),
                )
            )
        self.parts = LayerParts(attention_inputs, mlp_residual)

    def compile(self) -> None:
        """Each layer's dense parts through `torch.compile`, as LlamaRunner.compile (there, why); not on the CPU's
        packed weights."""
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
        x = F.embedding(batch.input_ids, self.embed) * self.embed_scale
        rope = {
            kind: rope_cos_sin(batch.positions, self.head_dim, self.rope_base[f"{kind}_attention"], x.dtype)
            for kind in ("sliding", "full")
        }
        parts, w = self.parts, self.parts.weight
        for i, layer in enumerate(self.layers):
            cos, sin = rope["sliding" if layer.sliding else "full"]
            q, k, v = parts.attention_inputs(x, layer.attn_norm, w(layer.wqkv), layer.q_norm, layer.k_norm, cos, sin,
                                             self.eps, self.num_heads, self.num_kv_heads, self.head_dim)
            window = self.sliding_window if layer.sliding else None
            attn = paged_attention(q, k, v, i, pool, batch, self.scale, window)
            x = parts.mlp_residual(x, attn, w(layer.wo), layer.post_attn_norm, layer.pre_mlp_norm, w(layer.w_gate_up),
                                   w(layer.w_down), layer.post_mlp_norm, self.eps)
        return gemma_rms_norm(x[rows], self.norm, self.eps)


def attention_inputs(x: torch.Tensor, norm: torch.Tensor, wqkv: Linear | torch.Tensor, q_norm: torch.Tensor,
                     k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int,
                     kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries, keys and values for x [T, hidden]: normed, projected, q and k normed per head and
    RoPE applied."""
    h = gemma_rms_norm(x, norm, eps)
    q, k, v = linear(h, wqkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = gemma_rms_norm(q.view(-1, heads, head_dim), q_norm, eps)
    k = gemma_rms_norm(k.view(-1, kv_heads, head_dim), k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(-1, kv_heads, head_dim)


def mlp_residual(x: torch.Tensor, attn: torch.Tensor, wo: Linear | torch.Tensor, post_attn_norm: torch.Tensor,
                 pre_mlp_norm: torch.Tensor, w_gate_up: Linear | torch.Tensor, w_down: Linear | torch.Tensor,
                 post_mlp_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """The rest of a layer after attention: output projection, normed, added; the tanh-GELU MLP between its
    two norms, added."""
    x = x + gemma_rms_norm(linear(attn, wo), post_attn_norm, eps)
    gate, up = linear(gemma_rms_norm(x, pre_mlp_norm, eps), w_gate_up).chunk(2, dim=-1)
    return x + gemma_rms_norm(linear(F.gelu(gate, approximate="tanh") * up, w_down), post_mlp_norm, eps)
