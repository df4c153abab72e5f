"""Linear layers with weights pre-packed for the CPU's matrix kernels.

On an AVX2/FMA CPU the weights are packed for this project's own kernel (cloud/avx2_linear.py): a pass of a few
rows streams each weight once, so the linear products of a tree of 8 nodes cost about 1.2x one token's, against
oneDNN's 1.5x, and one token's cost a quarter less than oneDNN's (BENCHMARKS.md section 1). Elsewhere on the CPU
oneDNN with a pre-packed weight runs them (SmolLM2's 30 layers in 35 ms for 1 token, 32 ms for 4 and 55 ms for
16, against 39 / 74 / 92 ms for `F.linear` on the row-major weight). On CUDA, and builds without oneDNN, the plain
weight and `F.linear` are used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specedge.cloud import avx2_linear


def _onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """y = x @ weight.T for x [T, in]; `weight` is [out, in] as in torch.nn.Linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.kernel = "avx2" if avx2_linear.usable_for(weight) else "onednn" if _onednn_available(weight) else "plain"
        self.packed = self.kernel != "plain"  # a CPU float32 layer (the plain weight is not kept)
        with torch.no_grad():
            if self.kernel == "avx2":
                self.weight = avx2_linear.pack(weight)
            elif self.kernel == "onednn":
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            else:
                self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "avx2":
            return avx2_linear.matmul(x, self.weight)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def linear(x: torch.Tensor, weight: Linear | torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a Linear, or for its plain weight tensor (what compiled layers are given, so that one
    compiled graph serves every layer: cloud/models/compiled.py)."""
    return weight(x) if isinstance(weight, Linear) else F.linear(x, weight)
