"""Building and loading this project's own C++ kernels for AVX2/FMA CPUs (cloud/avx2_*.cpp).

Each is built once, with the system's C++ compiler, into the cache's `kernels` folder (about a second; nothing is
downloaded), keyed by its source and flags, and loaded with ctypes. Where that cannot be (no AVX2/FMA, no compiler,
a failed build), `load` returns None, says why in the log, and the caller uses the library path it replaces.
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
from typing import Callable

from specedge.common.cache import cache_root, locked

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_log = logging.getLogger("specedge.engine")


class Kernel:
    """One kernel's library, built and loaded at the first `available()` unless the environment variable `switch`
    says other than "avx2"; `declare` gives its functions their ctypes signatures."""

    def __init__(self, source: Path, switch: str, fallback: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.switch, self.fallback, self.declare = source, switch, fallback, declare
        self.library: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        """The kernel is built and loaded (building it on first call), and not turned off."""
        with self._lock:
            if not self._tried:
                self._tried = True
                if os.environ.get(self.switch, "avx2") == "avx2":
                    self.library = load(self.source, self.fallback)
                    if self.library is not None:
                        self.declare(self.library)
            return self.library is not None


def cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def load(source: Path, fallback: str) -> ctypes.CDLL | None:
    """The built `source`, building it first where the cache lacks this source's build; None (logged, naming
    `fallback`, what runs instead) where this CPU or machine cannot have it."""
    if not cpu_has_avx2_fma():
        _log.info("no AVX2/FMA on this CPU: %s", fallback)
        return None
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        _log.info("no C++ compiler found: %s", fallback)
        return None
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    built = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    try:
        if not built.exists():
            with locked(built.with_suffix(".lock")):  # processes started together build it once
                if not built.exists():
                    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
                    subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial)], check=True,
                                   capture_output=True, timeout=300)
                    os.replace(partial, built)
        return ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _log.warning("%s could not be built (%s%s): %s", source.name, e,
                     f": {detail.decode(errors='replace')[-500:]}" if detail else "", fallback)
        return None
