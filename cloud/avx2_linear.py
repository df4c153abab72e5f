"""x @ W.T in float32 through this project's own kernel for AVX2/FMA CPUs (cloud/avx2_linear.cpp).

A verifier's passes on the CPU are a few rows each (a tree's nodes), and there a linear layer is bound by reading
its weight: the libraries' kernels cost 1.4-1.6x a one-row pass at 4-8 rows on this project's CPU, the kernel
here 1.1-1.2x, and its one-row pass is faster too (BENCHMARKS.md section 1). It is built once into the cache and
loaded with ctypes (cloud/cpu_kernels.py). Where it cannot be (no AVX2/FMA, no compiler,
SPECEDGE_CPU_LINEAR=onednn), `available()` is False and cloud/linear.py uses oneDNN.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specedge.cloud import cpu_kernels

SOURCE = Path(__file__).with_name("avx2_linear.cpp")
PANEL = 16  # outputs per panel of the packed weight: a layer's outputs must be a multiple of it


def _declare(library: ctypes.CDLL) -> None:
    p, n = ctypes.c_void_p, ctypes.c_long
    library.avx2_matmul.argtypes = [p, n, n, p, n, p, ctypes.c_int, ctypes.c_int]
    library.avx2_matmul.restype = None
    library.avx2_matmul_isa.argtypes = []
    library.avx2_matmul_isa.restype = ctypes.c_int


_kernel = cpu_kernels.Kernel(SOURCE, "SPECEDGE_CPU_LINEAR", "linear layers use oneDNN", _declare)
available = _kernel.available  # built and loaded (on first call), and not turned off
_isa: list[int] = []  # the instructions it runs with here: 2 AVX-512, 1 AVX2 (asked once)


def isa() -> int:
    """2 where the kernel runs on AVX-512 here (passes of 7-20 rows in groups of up to 10), 1 on AVX2: the same bits."""
    if not _isa:
        _isa.append(_kernel.library.avx2_matmul_isa())
    return _isa[0]


def usable_for(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can go through the kernel here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] % PANEL == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as the kernel reads it: panels of PANEL outputs, k by k ([N / PANEL, K, PANEL])."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, instructions: int | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for W packed by `pack`: [..., N]; `instructions` as `isa` says (None: the best here)."""
    panels, k, _ = packed.shape
    n = panels * PANEL
    # A pass's inputs are [rows, K] and contiguous: taken as they are, as the output is (a pass makes ~120 of
    # these calls; reshaping both ways cost ~2 of the call's ~8 us).
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, k).contiguous()
    if rows.dtype != torch.float32:
        raise TypeError(f"the AVX2 kernel takes float32 inputs, got {rows.dtype}")
    if rows.shape[1] != k:
        raise ValueError(f"inputs of {rows.shape[1]} features for a weight of {k}")
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _kernel.library.avx2_matmul(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n, y.data_ptr(),
                                    torch.get_num_threads(), instructions or isa())
    return y if flat else y.reshape(*x.shape[:-1], n)

