"""One of the project's C++ kernels (cloud/*.cpp) as of a commit, built as the working tree's are and loaded: the
kernel benches time it beside this tree's, because a machine's speed drifts between runs."""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

from specedge.cloud import cpu_kernels


def kernel_at(commit: str, source: str) -> ctypes.CDLL:
    """cloud/`source` at `commit`, built (once, into the kernels' cache) and loaded; its functions undeclared."""
    text = subprocess.run(["git", "show", f"{commit}:cloud/{source}"], capture_output=True, check=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / source
    path.write_bytes(text)
    library = cpu_kernels.load(path, "nothing")
    if library is None:
        raise SystemExit(f"cloud/{source} of {commit} could not be built here")
    return library
