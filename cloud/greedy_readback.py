"""A greedy step's results read back from a device in one transfer: each row's argmax (what the verdict needs)
and, for sessions that ask, the row's top k tokens with their probabilities (the hints, cloud/hints.py).

They are computed where the logits lie and packed into one int32 tensor [rows, 1 + 2k] (the probabilities as
their float32 bits), so a step waits for the device once; separate copies of the argmax, the hint ids and
their probabilities waited three times. Compiled (where the engine's layers are), the reductions run as a
few fused kernels where eager mode launches about a dozen, which is most of what hints cost a GPU step
(BENCHMARKS.md section 9, `hint_ops`).
"""

from __future__ import annotations

import numpy as np
import torch

from specedge.cloud.models.compiled import compiled_or_eager
from specedge.common.hints import Hints


def pack(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 1 + 2k] int32 of `logits` [rows, V]: each row's argmax, its top k ids (most likely first) and
    their probabilities at temperature 1 (float32 bits). The top k are searched in the logits' own number
    format, the normaliser summed in float32 (as `top_k_hints_plain`)."""
    argmax = logits.argmax(-1, keepdim=True).int()
    if k == 0:
        return argmax
    values, ids = logits.topk(k, dim=-1)
    probs = (values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    return torch.cat([argmax, ids.int(), probs.view(torch.int32)], dim=1)


class GreedyRows:
    """`pack`'s result on the host, read by row ranges (a session's rows)."""

    def __init__(self, packed: np.ndarray) -> None:
        self.packed = packed
        self.k = (packed.shape[1] - 1) // 2

    def argmax(self, start: int, end: int) -> torch.Tensor:
        return torch.from_numpy(self.packed[start:end, 0].astype(np.int64))

    def hints(self, start: int, end: int, k: int) -> Hints:
        """The rows' top `k` (at most the packed k: the first k of a longer top list are the top k)."""
        if not 0 < k <= self.k:
            raise ValueError(f"hints of {k} tokens asked from rows packed with {self.k}")
        rows = self.packed[start:end]
        probs = np.ascontiguousarray(rows[:, 1 + self.k : 1 + self.k + k]).view(np.float32)
        return Hints(rows[:, 1 : 1 + k].tolist(), probs.tolist())


class GreedyReadback:
    """`pack` on the device (through torch.compile if `compiled`), then one copy to the host."""

    def __init__(self, compiled: bool = False) -> None:
        self._pack = compiled_or_eager(pack) if compiled else pack

    def __call__(self, logits: torch.Tensor, k: int) -> GreedyRows:
        return GreedyRows(self._pack(logits, k).cpu().numpy())
