"""Where a verifier's engine runs (`--device`), in which number format (`--dtype`), and whether its layers are
compiled (`--compile`)."""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")
COMPILE = ("auto", "on", "off")
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


def compile_layers(setting: str, device: torch.device) -> bool:
    """Whether `--compile` compiles the layers' dense parts. auto: on a GPU, where it makes every pass ~20%
    cheaper (BENCHMARKS.md section 9, run 9); not on the CPU, whose oneDNN-packed matrix kernels it cannot use."""
    if setting not in COMPILE:
        raise ValueError(f"--compile {setting!r}: expected one of {', '.join(COMPILE)}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")
