"""Per-client limits: the open sessions of each client identity (cloud/identity.py), and the tokens they
claim (prompt + max_new_tokens: what their KV may come to hold). A verifier counts the sessions it serves; a
router counts those it relays, across all its verifiers, so that a client cannot take a verifier's limit
once per verifier."""

from __future__ import annotations

from collections import Counter

from specedge.common import wire


class LimitExceeded(Exception):
    """A session the client's limits do not allow now (RESOURCE_EXHAUSTED; the message says which)."""


class ClientLimits:
    def __init__(self, max_sessions: int = 0, max_tokens: int = 0) -> None:
        """0: no limit."""
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self.sessions: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    def admit(self, client: str, tokens: int) -> None:
        """Count a new session of `client` that claims `tokens`, or raise LimitExceeded."""
        if self.max_sessions and self.sessions[client] >= self.max_sessions:
            raise LimitExceeded(f"client {wire.shown(client)} already has {self.max_sessions} open sessions")
        if self.max_tokens and self.tokens[client] + tokens > self.max_tokens:
            raise LimitExceeded(f"client {wire.shown(client)} has sessions claiming {self.tokens[client]} tokens; "
                                f"this one (prompt + max_new_tokens = {tokens}) would pass its limit of "
                                f"{self.max_tokens}")
        self.sessions[client] += 1
        self.tokens[client] += tokens

    def release(self, client: str, tokens: int) -> None:
        for usage, amount in ((self.sessions, 1), (self.tokens, tokens)):
            usage[client] -= amount
            if usage[client] <= 0:
                del usage[client]

    @property
    def open_sessions(self) -> int:
        return sum(self.sessions.values())
