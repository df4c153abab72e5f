"""Who a request comes from, for the per-client limits: an identity the caller has proven, never one it
declares (a client could otherwise open sessions under as many made-up `client_id`s as it likes).

In order: the common name of its verified client certificate (mutual TLS), `cert:NAME`; the name given to
the bearer token it presented (an `--auth-tokens` file), `token:NAME`; else the address it connects from,
its IP without the port, `peer:ipv4:10.0.0.7` (one shared `--auth-token` says nothing about who holds it).
A caller whose own identity is listed as a trusted relay (a router passing sessions through) speaks for its
clients: their identity comes in CLIENT_IDENTITY metadata, as the relay established it. The `client_id` a
client sends is a label for logs, nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CLIENT_IDENTITY = "specedge-client-identity"
MAX_IDENTITY = 256  # characters; a relay's claim is cut to this


def read_token_file(path: str | Path) -> dict[str, str]:
    """`NAME TOKEN` per line (blank lines and `#` comments skipped) -> {token: name}."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected `NAME TOKEN`, got {len(parts)} fields")
        name, token = parts
        if not (name.isascii() and name.isprintable()):  # it travels in gRPC metadata, relayed by a router
            raise ValueError(f"{path}:{number}: a NAME must be printable ASCII")
        if token in tokens:
            raise ValueError(f"{path}:{number}: this token is already {tokens[token]!r}'s")
        tokens[token] = name
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


@dataclass
class Identities:
    tokens: dict[str, str] = field(default_factory=dict)  # bearer token -> its holder's name
    relays: frozenset[str] = frozenset()  # identities that may speak for their clients

    def of(self, context) -> str:
        """The identity a gRPC call's limits count against (`context`: its ServicerContext)."""
        own = self.own(context)
        if own in self.relays:
            claimed = dict(context.invocation_metadata() or ()).get(CLIENT_IDENTITY)
            if claimed:
                return claimed[:MAX_IDENTITY]
        return own

    def own(self, context) -> str:
        names = (context.auth_context() or {}).get("x509_common_name")
        if names:
            return "cert:" + names[0].decode("utf-8", "replace")[:MAX_IDENTITY]
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        if header.startswith("Bearer ") and (name := self.tokens.get(header[len("Bearer "):])) is not None:
            return "token:" + name
        return "peer:" + peer_host(context.peer())


def peer_host(peer: str) -> str:
    """gRPC's peer string without the port: `ipv4:1.2.3.4:5678` -> `ipv4:1.2.3.4`, `ipv6:[::1]:5678` ->
    `ipv6:[::1]`; a Unix socket's path stays whole."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        address = address.rsplit(":", 1)[0]
    return f"{kind}:{address}" if address else kind
