"""Which tokens each new token of a step may attend to: a draft tree's nodes see their ancestors only."""

from __future__ import annotations

import numpy as np
import torch

from specedge.common.draft_tree import DraftTree


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """Bool [n + 1, n + 1] over [root] + nodes: [a, b] is True iff b is a or an ancestor of a."""
    return torch.from_numpy(_ancestors(tree))


def _ancestors(tree: DraftTree) -> np.ndarray:
    n = len(tree)
    mask = np.zeros((n + 1, n + 1), dtype=np.bool_)  # numpy: row copies ~10x cheaper than torch's here
    mask[0, 0] = True
    for i, parent in enumerate(tree.parents):
        mask[i + 1] = mask[parent + 1]
        mask[i + 1, i + 1] = True
    return mask


def step_mask(cached: int, chain: int, tree: DraftTree) -> torch.Tensor | None:
    """[n, cached + n] visibility: all cached tokens, the causal chain, and each tree node's ancestors."""
    n = chain + len(tree)
    if n == 1:
        return None
    mask = np.zeros((n, cached + n), dtype=np.bool_)  # built in numpy: a step builds one per sequence
    mask[:, :cached] = True
    new = mask[:, cached:]
    new[:chain, :chain] = np.tri(chain, dtype=np.bool_)
    new[chain:, : chain - 1] = True
    new[chain - 1 :, chain - 1 :] |= _ancestors(tree)
    return torch.from_numpy(mask)
