"""A function compiled by `torch.compile` that falls back to running eagerly where compiling fails.

Compiling needs Triton and a C compiler on the verifier's machine; a server must not die at its first step
because one is missing, so the first failure is logged and the plain function runs from then on.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

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
