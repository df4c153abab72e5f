"""How far this generation's acceptance strays from the estimates learned over all of them: one logit shift.

A draft source's acceptance estimates are learned across generations, but how much a text repeats is a
property of the text: within one generation they err in one direction more often than not (retrieval alone
at 80 ms on Spec-Bench accepted 0.68-0.83 of what it expected on extraction prompts, 1.12-1.20 on rag;
BENCHMARKS.md section 6). So each generation fits one shift b to the logits of its sources' estimates from
its own verdicts so far: the most probable b under a normal prior of scale PRIOR_SCALE around 0 (worth the
evidence of ~16 nodes at even odds), so a generation starts from the long-run estimates and leaves them as
its evidence grows. The estimates are those of the long-run tables as they are now (which learn from the
same verdicts): b is what they still miss. It is refitted after every verdict from the last b: a verdict
moves the fit little, so Newton's method usually stops after one or two steps (TOLERANCE) rather than four,
which matters as the edge reads every verdict before its next draft.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

PRIOR_SCALE = 0.5
GENERATION_NODES = 4096  # the shift is fitted to the generation's last this many reached nodes
TOLERANCE = 1e-3  # the fit after each verdict stops at a Newton step shorter than this (in logit)
MAX_LOGIT = 8.0  # estimates of 0 or 1 are held just inside them, so that any shift can move them


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1.0 - 1e-12)
    return np.clip(np.log(p / (1.0 - p)), -MAX_LOGIT, MAX_LOGIT)


def shifted(p: np.ndarray, shift: float) -> np.ndarray:
    """The estimates `p` with their logits moved by `shift` (unchanged when it is 0)."""
    if shift == 0.0:
        return np.asarray(p, dtype=np.float64)
    return 1.0 / (1.0 + np.exp(-(logit(p) + shift)))


def shifted_value(p: float, shift: float) -> float:
    """`shifted` for one estimate, without numpy's per-call cost (an edge reads a dozen per draft)."""
    if shift == 0.0:
        return p
    p = min(max(p, 1e-12), 1.0 - 1e-12)
    return 1.0 / (1.0 + math.exp(-(min(max(math.log(p / (1.0 - p)), -MAX_LOGIT), MAX_LOGIT) + shift)))


def fit_shift(p: np.ndarray, accepted: np.ndarray, start: float = 0.0, steps: int = 4, tolerance: float = 0.0
              ) -> float:
    """The shift b that makes estimates `p` of nodes reached this generation best explain whether each was
    `accepted`: Newton's method on the log-likelihood plus the prior (concave in b, so it converges), at most
    `steps` steps, stopping after a step shorter than `tolerance`."""
    z = logit(p)
    y = np.asarray(accepted, dtype=np.float64)
    b = start
    for _ in range(steps):
        q = 1.0 / (1.0 + np.exp(-(z + b)))
        gradient = float(np.sum(y - q)) - b / PRIOR_SCALE**2
        curvature = float(np.sum(q * (1.0 - q))) + 1.0 / PRIOR_SCALE**2
        b += gradient / curvature
        if abs(gradient / curvature) < tolerance:
            break
    return b


class GenerationShift:
    """One generation's shift of a source's estimates. `long_run(keys, priors)` gives the source's long-run
    estimates, as they are now, of nodes the source described by a table key and a prior."""

    def __init__(self, long_run: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.value = 0.0
        self._long_run = long_run
        self._keys = np.zeros(GENERATION_NODES, dtype=np.int64)  # a ring of the generation's reached nodes
        self._priors = np.zeros(GENERATION_NODES)
        self._accepted = np.zeros(GENERATION_NODES, dtype=bool)
        self._seen = 0

    def begin(self) -> None:
        self.value, self._seen = 0.0, 0

    def apply(self, p: np.ndarray) -> np.ndarray:
        return shifted(p, self.value)

    def observe(self, keys: np.ndarray, priors: np.ndarray, accepted: np.ndarray) -> None:
        """Reached nodes and whether each was accepted (after the long-run tables learned them)."""
        k = min(len(keys), GENERATION_NODES)
        if k == 0:
            return
        at = (self._seen + np.arange(k)) % GENERATION_NODES
        self._keys[at], self._priors[at], self._accepted[at] = keys[-k:], np.asarray(priors)[-k:], accepted[-k:]
        self._seen += k
        n = min(self._seen, GENERATION_NODES)
        self.value = fit_shift(self._long_run(self._keys[:n], self._priors[:n]), self._accepted[:n], self.value,
                               tolerance=TOLERANCE)
