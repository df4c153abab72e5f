"""Pass costs measured on a GPU (bench/gpu_bench.py's JSON) as the cost models that replays price passes with
(bench/gpu_projection.py, bench/replay.py --cost gpu:...)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specedge.common.cost_model import CostModel


def single_session_costs(shape: dict, hints: int) -> dict[int, CostModel]:
    """context -> cost by tree tokens (a pass computes tree tokens + 1), one session per step."""
    by_context: dict[int, list] = {}
    for r in shape["by_tree_tokens"]:
        if r.get("hints", 0) == hints:
            by_context.setdefault(r["context"], []).append((r["tokens"] - 1, r["ms"]))
    return {c: CostModel(tuple(sorted(points))) for c, points in by_context.items()}


def nearest_context(costs: dict[int, CostModel]) -> Callable[[int], CostModel]:
    """A session's cost model: the one measured at the context nearest its own."""
    return lambda context: costs[min(costs, key=lambda c: abs(c - context))]


def pass_costs(path: Path, shape: str, hints: int = 0) -> Callable[[int], CostModel]:
    """`shape`'s one-session pass costs in the JSON at `path` (with `hints` hint tokens a row), by context."""
    shapes = {s["shape"]: s for s in json.loads(Path(path).read_text())["shapes"]}
    if shape not in shapes:
        raise ValueError(f"{path} has no shape {shape!r} (it has {', '.join(shapes)})")
    costs = single_session_costs(shapes[shape], hints)
    if not costs:
        raise ValueError(f"{path} has no one-session costs of {shape} with {hints} hint tokens")
    return nearest_context(costs)
