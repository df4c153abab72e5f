"""Where a session goes: a pure choice among the verifiers in the pool, by prefix-cache affinity balanced
against load, per request.

The verifier holding the longest cached prefix of the prompt wins unless its load exceeds the least-loaded
verifier's by more than `balance_threshold`; then the best-cached of those within the threshold wins. So a
saturated verifier loses requests to the others without turning affinity off for the rest of the fleet
(SGLang's router falls back to shortest-queue for everyone when the fleet as a whole is imbalanced).
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("affinity", "least-loaded", "round-robin")


@dataclass(frozen=True)
class Candidate:
    address: str
    load: float  # sessions and queued requests
    cached_tokens: int  # prompt tokens its prefix cache holds
    placed: int  # sessions this router has placed on it: spreads otherwise equal choices


@dataclass(frozen=True)
class Placement:
    address: str
    reason: str  # "affinity" (for its cache), "load" (least loaded) or "round-robin"
    cached_tokens: int


class NoVerifier(Exception):
    """No verifier is in the pool (all down, draining, or excluded for this request)."""


def place(candidates: list[Candidate], policy: str = "affinity", balance_threshold: float = 4.0,
          turn: int = 0) -> Placement:
    """The verifier for one session. `turn` counts placements (round-robin uses it)."""
    if not candidates:
        raise NoVerifier("no verifier is serving")
    if policy == "round-robin":
        chosen = sorted(candidates, key=lambda c: c.address)[turn % len(candidates)]
        return Placement(chosen.address, "round-robin", chosen.cached_tokens)
    if policy == "affinity":
        least = min(c.load for c in candidates)
        eligible = [c for c in candidates if c.load <= least + balance_threshold]
        best = max(eligible, key=lambda c: (c.cached_tokens, -c.load, -c.placed))
        if best.cached_tokens > 0:
            return Placement(best.address, "affinity", best.cached_tokens)
    elif policy != "least-loaded":
        raise ValueError(f"unknown placement policy {policy!r}; choose from {', '.join(POLICIES)}")
    chosen = min(candidates, key=lambda c: (c.load, c.placed, c.address))
    return Placement(chosen.address, "load", chosen.cached_tokens)
