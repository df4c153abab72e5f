"""The verifier's pass time by draft-tree tokens, learned from the passes it runs: the cost model it
advertises to clients and trims shared steps by."""

from __future__ import annotations

import bisect

from specedge.common.cost_model import CostModel

# Pass time relative to a pass with no draft, by draft tokens, measured on the 2-core CPU here (BENCHMARKS.md
# section 7, "Where the tokens are lost": SmolLM2-135M, bench/engine_bench.py's passes with logits, 400- and
# 800-token contexts, three runs smoothed): up to ~6 nodes the weights' reads bound a pass, beyond, each node's products. Used for sizes not
# measured yet.
PRIOR_RELATIVE = {0: 1.0, 1: 1.08, 2: 1.08, 3: 1.09, 4: 1.09, 6: 1.09, 8: 1.25, 12: 1.7, 16: 1.9, 24: 2.8,
                  32: 3.6, 64: 6.8, 128: 14.0}
# The same on a GPU: one session of the Llama-3.1-8B shape on an H200, 512-token context (BENCHMARKS.md
# section 9; the steepest of the shapes measured there). A pass is nearly flat in its tokens.
GPU_PRIOR_RELATIVE = {0: 1.0, 1: 1.06, 2: 1.07, 3: 1.09, 4: 1.09, 6: 1.1, 8: 1.11, 12: 1.18, 16: 1.22, 24: 1.24,
                      32: 1.25, 64: 1.31, 128: 1.43}
assert GPU_PRIOR_RELATIVE.keys() == PRIOR_RELATIVE.keys()  # the same buckets


class CostTracker:
    """Exponential moving averages of measured pass times in power-of-two buckets of tree tokens."""

    def __init__(self, base_ms: float = 50.0, alpha: float = 0.2, prior: dict[int, float] = PRIOR_RELATIVE) -> None:
        self.alpha = alpha
        self.base_ms = base_ms
        self.prior = prior
        self.measured: dict[int, float] = {}  # bucket (a key of PRIOR_RELATIVE) -> ms

    @classmethod
    def for_device(cls, device) -> CostTracker:
        """A tracker whose prior (for sizes not measured yet) is the curve of `device`'s kind."""
        if getattr(device, "type", device) == "cuda":
            return cls(base_ms=8.0, prior=GPU_PRIOR_RELATIVE)
        return cls()

    @staticmethod
    def bucket(tree_tokens: int) -> int:
        sizes = list(PRIOR_RELATIVE)
        return sizes[min(bisect.bisect_left(sizes, tree_tokens), len(sizes) - 1)]

    def observe(self, tree_tokens: int, ms: float) -> None:
        b = self.bucket(tree_tokens)
        old = self.measured.get(b)
        self.measured[b] = ms if old is None else old + self.alpha * (ms - old)

    def model(self) -> CostModel:
        """Measured buckets as they are; the others scaled from the prior by the nearest measured one below
        (above, where none is below). A model's curve can be much steeper than the prior's (Gemma 3 270M
        here: ~13 ms a node on a 95 ms pass, BENCHMARKS.md section 6), and scaling every size by the smallest
        measured one priced sizes beyond the measured ones as no dearer than the largest of them."""
        points, last = [], 0.0
        measured = sorted(self.measured)
        for n, rel in self.prior.items():
            ms = self.measured.get(n)
            if ms is None:
                below = [m for m in measured if m < n]
                m = below[-1] if below else (measured[0] if measured else None)
                ms = self.base_ms * rel if m is None else self.measured[m] * rel / self.prior[m]
            last = max(last, ms)  # a pass with more tokens never costs less: smooth out noise
            points.append((n, last))
        return CostModel(tuple(points))
