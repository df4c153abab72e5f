"""A model's output layer: the logits of the rows that need them, only the argmax of the rows that need no more.

Greedy verification needs each row's argmax alone, and its hints each row's top k; on the CPU both come from the
int8 argmax (cloud/int8_argmax.py: exact, a quarter of the bytes), built when first asked for and shared by
every layer over the same weight (tests and benchmarks build many engines from one loaded model).
"""

from __future__ import annotations

import threading
import weakref

import torch

from specedge.cloud.hints import top_k_hints
from specedge.cloud.int8_argmax import Int8Argmax
from specedge.cloud.linear import Linear
from specedge.common.hints import Hints

# id(weight) -> its int8 argmax, while some layer holds it
_shared: weakref.WeakValueDictionary[int, Int8Argmax] = weakref.WeakValueDictionary()
_building = threading.Lock()


class OutputLayer:
    def __init__(self, weight: torch.Tensor, softcap: float | None = None) -> None:
        self.weight = weight
        self.linear = Linear(weight)
        self.softcap = softcap
        self._fast: Int8Argmax | None = None
        self._fast_for: int | None = None  # the weight's _version the int8 argmax was built for (or found missing)

    @property
    def packed(self) -> bool:
        return self.linear.packed

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, V] logits for final hidden states h [N, D] (normed)."""
        logits = self.linear(h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """argmax(self.logits(h), -1), computed as cheaply as the rows' number allows."""
        fast = self._int8_argmax_for(h)
        if fast is None:
            return self.logits(h).argmax(-1)
        best = fast(h)
        unsettled = best < 0
        if unsettled.any():
            best[unsettled] = self.logits(h[unsettled]).argmax(-1)
        return best

    @torch.inference_mode()
    def argmax_and_hints(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, Hints]:
        """What a greedy session that asks for hints needs: each row's argmax (exact, as `argmax`) and its k
        likeliest tokens with their probabilities (cloud/hints.py). From the int8 argmax the top k are exact
        and the softmax's normaliser counts the tokens outside the few computed exactly at their int8 logit
        (each off by less than its bound), which hints, a drafting aid, can afford."""
        fast = self._int8_argmax_for(h)
        if fast is None:
            logits = self.logits(h)
            return logits.argmax(-1), top_k_hints(logits, k)
        ids, top, approx = fast.top_k(h, k)
        argmax = ids[:, 0].clone()
        unsettled = (argmax < 0).nonzero().squeeze(1)
        if len(unsettled):
            logits = self.logits(h[unsettled])
            approx[unsettled] = logits
            argmax[unsettled] = logits.argmax(-1)
            top[unsettled], ids[unsettled] = logits.topk(k, dim=-1)
        norm = (approx - top[:, :1]).exp_().sum(1, keepdim=True)
        probs = (top - top[:, :1]).exp_().div_(norm)
        return argmax, Hints(ids.tolist(), probs.tolist())

    def prepare(self) -> bool:
        """Build the int8 argmax now rather than at the first greedy step (seconds at Gemma 3's 262k tokens);
        whether there is one."""
        return self._int8_argmax() is not None

    def _int8_argmax_for(self, h: torch.Tensor) -> Int8Argmax | None:
        """The int8 argmax where it pays for rows h: up to its max_rows of them."""
        fast = self._int8_argmax() if len(h) else None
        return fast if fast is not None and len(h) <= fast.max_rows else None

    def _int8_argmax(self) -> Int8Argmax | None:
        # Only for a plain float32 CPU layer: softcapping in float32 can tie logits that differ, and the
        # tie-break would then depend on which were computed.
        if not self.packed or self.softcap is not None:
            return None
        version = self.weight._version  # changed by in-place writes: the int8 copy would be stale
        if self._fast_for != version:
            with _building:
                fast = _shared.get(id(self.weight))
                if fast is None or fast.weight is not self.weight or fast.version != version:
                    fast = Int8Argmax.build(self.weight)
                    if fast is not None:
                        _shared[id(self.weight)] = fast
            self._fast, self._fast_for = fast, version
        return self._fast
