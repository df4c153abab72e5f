"""x @ W.T in float32 through this project's own kernel for AVX2/FMA CPUs (cloud/avx2_linear.cpp).

A verifier's passes on the CPU are a few rows each (a tree's nodes), and there a linear layer is bound by reading
its weight: the libraries' kernels cost 1.4-1.6x a one-row pass at 4-8 rows on this project's CPU, the kernel
here 1.1-1.2x, and its one-row pass is faster too (BENCHMARKS.md section 1). It is built once, with the system's
C++ compiler, into the cache (about a second; nothing is downloaded), and loaded with ctypes. Where it cannot be
(no AVX2/FMA, no compiler, SPECEDGE_CPU_LINEAR=onednn), `available()` is False and cloud/linear.py uses oneDNN.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from specedge.common.cache import cache_root, locked

SOURCE = Path(__file__).with_name("avx2_linear.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PANEL = 16  # outputs per panel of the packed weight: a layer's outputs must be a multiple of it

_log = logging.getLogger("specedge.engine")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def available() -> bool:
    """The kernel is built and loaded (building it on first call), and not turned off."""
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("SPECEDGE_CPU_LINEAR", "avx2") == "avx2" and _cpu_has_avx2_fma():
                _library = _load()
        return _library is not None


def usable_for(weight: torch.Tensor) -> bool:
    """Whether `weight` [out, in] can go through the kernel here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] % PANEL == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as the kernel reads it: panels of PANEL outputs, k by k ([N / PANEL, K, PANEL])."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T for W packed by `pack`: [..., N]."""
    panels, k, _ = packed.shape
    n = panels * PANEL
    rows = x.reshape(-1, k).contiguous()
    if rows.dtype != torch.float32:
        raise TypeError(f"the AVX2 kernel takes float32 inputs, got {rows.dtype}")
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _library.avx2_matmul(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n, y.data_ptr(),
                             torch.get_num_threads())
    return y.reshape(*x.shape[:-1], n)


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _load() -> ctypes.CDLL | None:
    """The built kernel, building it first where the cache lacks this source's build; None (logged) if it fails."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        _log.info("no C++ compiler found: linear layers use oneDNN")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    built = cache_root() / "kernels" / f"avx2_linear-{key}.so"
    try:
        if not built.exists():
            with locked(built.with_suffix(".lock")):  # processes started together build it once
                if not built.exists():
                    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
                    subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True,
                                   capture_output=True, timeout=300)
                    os.replace(partial, built)
        library = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _log.warning("the AVX2 linear kernel could not be built (%s%s): linear layers use oneDNN", e,
                     f": {detail.decode(errors='replace')[-500:]}" if detail else "")
        return None
    p, n = ctypes.c_void_p, ctypes.c_long
    library.avx2_matmul.argtypes = [p, n, n, p, n, p, ctypes.c_int]
    library.avx2_matmul.restype = None
    return library
