"""How many draft nodes are worth verifying: the one rule behind the edge's choice of tree size
(edge/controller.py) and the verifier's trimming of a shared step (cloud/step_plan.py).

Nodes are taken best first, so any prefix of them is a tree, and node i is accepted with probability
accept_probs[i] (its path probability: never more than its parent's). Verifying the first n nodes commits
`base + sum(accept_probs[:n])` tokens in expectation (`base`: the tokens the pass commits anyway, one
bonus token per session) and takes `pass_ms[n] + overhead_ms`. The best n is the one with the most
expected tokens per millisecond.
"""

from __future__ import annotations

import numpy as np

MAX_TREE_NODES = 64  # the most draft nodes an edge sends in one round, unless told otherwise


def best_tree_size(accept_probs, pass_ms: np.ndarray, base: float = 1.0, overhead_ms: float = 0.0,
                   most_tokens: float = np.inf) -> int:
    """The n in [0, len(accept_probs)] that maximises expected committed tokens per millisecond (the smallest
    such n on ties). `pass_ms[n]` is the pass time with n nodes; `most_tokens` caps what a pass can commit
    (e.g. the tokens a generation has left)."""
    probs = np.asarray(accept_probs, dtype=np.float64)
    expected = np.minimum(base + np.concatenate(([0.0], np.cumsum(probs))), most_tokens)
    rate = expected / (np.asarray(pass_ms[: len(probs) + 1], dtype=np.float64) + overhead_ms)
    return int(np.argmax(rate))
