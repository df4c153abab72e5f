"""A sequence's attention over the paged KV pool through this project's own kernel for AVX2/FMA CPUs
(cloud/avx2_attention.cpp).

The pool holds a layer's keys and values as [slot, kv head, dim]; the batched products of cloud/attention.py read
one head's keys through a strided view at a few GB/s, so that on SmolLM2 a one-token pass over a 900-token context
spent a quarter of its time in attention. The kernel reads each key and value where it lies, once for all the queries
of its kv head, and keeps scores, softmax and the values' weighted sum in cache (BENCHMARKS.md section 1). Built and
loaded as cloud/cpu_kernels.py says; where it cannot be, or with SPECEDGE_CPU_ATTENTION=torch, `available()` is
False and attention stays on torch's products.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specedge.cloud import cpu_kernels

SOURCE = Path(__file__).with_name("avx2_attention.cpp")


def _declare(library: ctypes.CDLL) -> None:
    p, n = ctypes.c_void_p, ctypes.c_long
    library.avx2_paged_attention.argtypes = [p, n, n, n, n, p, p, n, p, n, p, ctypes.c_int, ctypes.c_float, p,
                                             ctypes.c_int, ctypes.c_int]
    library.avx2_paged_attention.restype = None
    library.avx2_attention_isa.argtypes = []
    library.avx2_attention_isa.restype = ctypes.c_int


_kernel = cpu_kernels.Kernel(SOURCE, "SPECEDGE_CPU_ATTENTION", "attention uses torch's products", _declare)
available = _kernel.available  # built and loaded (on first call), and not turned off


@functools.cache
def isa() -> int:
    """The instructions the kernel runs with here: 2 for AVX-512 (the values' weighted sums, six rows a read), 1 for
    AVX2 alone (the same bits either way)."""
    return _kernel.library.avx2_attention_isa()


def usable_for(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether queries q [n, H, D] over a layer's pool `cache` [slots, KVH, D] can go through the kernel here."""
    return (q.device.type == "cpu" and q.dtype == cache.dtype == torch.float32 and q.shape[-1] % 32 == 0
            and available())


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor | None, scale: float, out: torch.Tensor | None = None, causal: bool = False,
              instructions: int | None = None) -> torch.Tensor:
    """q [n, H, D] over the pool slots `slots` [C] of one layer's k_cache / v_cache [S, KVH, D] -> [n, H * D]
    (written into `out` where given, a contiguous float32 [n, H * D]).

    Query head h reads kv head h // (H / KVH); `mask` [n, C] (nonzero = visible) or None when every row sees every
    slot. `causal`: besides, row i sees no slot after slot C - n + i (the rows are the context's last n tokens, a
    prompt's chain), which spares the kernel the keys past a block's last row. `instructions`: 1 to run on AVX2
    alone (tests, benches), else `isa()`."""
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.contiguous()
    slots = slots.to(torch.int64).contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the kernel reads the pool in place: its caches must be contiguous")
    if causal and n > len(slots):
        raise ValueError(f"a causal chain of {n} rows over {len(slots)} slots: its rows are the context's last tokens")
    visible = None if mask is None else mask.to(torch.uint8).contiguous()
    if out is None:
        out = torch.empty(n, heads * head_dim, dtype=torch.float32)
    elif not (out.is_contiguous() and out.shape == (n, heads * head_dim) and out.dtype == torch.float32):
        raise ValueError(f"out must be a contiguous float32 [{n}, {heads * head_dim}], got {out.dtype} {out.shape}")
    if n:
        visible_ptr = None if visible is None else visible.data_ptr()
        _kernel.library.avx2_paged_attention(
            q.data_ptr(), n, heads, kv_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(), kv_heads * head_dim,
            slots.data_ptr(), len(slots), visible_ptr, int(causal), scale, out.data_ptr(), torch.get_num_threads(),
            isa() if instructions is None else instructions)
    return out

