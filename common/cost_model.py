"""The verifier's cost of one pass as a function of draft-tree tokens, as it advertises it (learned by
cloud/cost_tracker.py). Clients size their trees from it (DESIGN.md: "keep the verifier's cost model
explicit and reportable")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of one verification pass by tree tokens, linear between known points."""

    points: tuple[tuple[int, float], ...]  # (tree tokens, ms), increasing tokens, starting at 0

    def ms(self, tree_tokens: int) -> float:
        return float(_interpolate(self.points, np.array([tree_tokens], dtype=np.float64))[0])

    def table(self, max_tokens: int) -> np.ndarray:
        """Milliseconds for 0, 1, ..., max_tokens tree tokens (the last segment extends past the last point).
        Read-only: kept per model and size, as an edge asks for it before every draft it sends."""
        return _table(self.points, max_tokens)

    def at_load(self, other_tokens: int) -> CostModel:
        """The pass time one session sees for each tree size when `other_tokens` of other sessions share
        its pass (sampled at the known sizes and where the curve's known points fall after the shift, so a
        bend in the curve stays where it is)."""
        if other_tokens == 0:
            return self
        sizes = sorted({n for n, _ in self.points} | {n - other_tokens for n, _ in self.points if n > other_tokens})
        times = _interpolate(self.points, other_tokens + np.array(sizes, dtype=np.float64))
        return CostModel(tuple(zip(sizes, times.tolist())))


@functools.lru_cache(maxsize=1024)
def _table(points: tuple[tuple[int, float], ...], max_tokens: int) -> np.ndarray:
    out = _interpolate(points, np.arange(max_tokens + 1, dtype=np.float64))
    out.flags.writeable = False
    return out


def _interpolate(points: tuple[tuple[int, float], ...], tokens: np.ndarray) -> np.ndarray:
    """Milliseconds at each of `tokens`: linear between the points, the last segment extended past them."""
    sizes = np.array([n for n, _ in points], dtype=np.float64)
    times = np.array([t for _, t in points], dtype=np.float64)
    out = np.interp(tokens, sizes, times)
    if len(sizes) > 1:
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        beyond = tokens > sizes[-1]
        out[beyond] = times[-1] + slope * (tokens[beyond] - sizes[-1])
    return out
