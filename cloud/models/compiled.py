"""A function compiled by `torch.compile` that falls back to running eagerly where compiling fails.

Compiling needs Triton and a C compiler on the verifier's machine; a server must not die at its first step
because one is missing, so the first failure is logged and the plain function runs from then on.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from specedge.cloud.linear import Linear

log = logging.getLogger(__name__)


def compiled_or_eager(fn: Callable) -> Callable:
    """`fn` through `torch.compile` (shapes dynamic: one compiled graph serves every token count but one,
    which is specialised); on any error in a compiled call, `fn` itself, for that call and every later one."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    use = compiled

    def call(*args):
        nonlocal use
        if use is fn:
            return fn(*args)
        try:
            return use(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: run eagerly, and say so once
            log.warning("torch.compile of %s failed (%s: %s); it runs eagerly from now on", fn.__name__,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            use = fn
            return fn(*args)

    return call


class LayerParts:
    """A runner's two dense parts of a layer (before and after attention), as plain functions or compiled.
    Compiled, they are given each Linear's plain weight tensor (`weight`), so that one compiled graph serves
    every layer."""

    def __init__(self, attention_inputs: Callable, mlp_residual: Callable) -> None:
        self.attention_inputs, self.mlp_residual = attention_inputs, mlp_residual
        self.compiled = False

    def weight(self, linear: Linear) -> Linear | torch.Tensor:
        return linear.weight if self.compiled else linear

    def compile(self) -> None:
        self.attention_inputs = compiled_or_eager(self.attention_inputs)
        self.mlp_residual = compiled_or_eager(self.mlp_residual)
        self.compiled = True
