"""Where a verifier's engine runs (`--device`) and in which number format (`--dtype`)."""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_device(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The device and dtype that `--device` and `--dtype` name. auto: CUDA when a GPU is visible, else the
    CPU; bfloat16 on a GPU (tensor cores, the range of float32) and float32 on the CPU (its matrix kernels
    here are fastest in float32, and it is the precision greedy parity with transformers is tested in)."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to this process (torch.cuda.is_available() is "
                         "False; a CPU-only torch build, or no driver); use --device cpu")
    chosen = DTYPES[dtype] or (torch.bfloat16 if device == "cuda" else torch.float32)
    return torch.device(device), chosen
