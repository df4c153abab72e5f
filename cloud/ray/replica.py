"""A verifier replica as a Ray actor: the normal gRPC verifier (cloud/launch.py's EmbeddedVerifier), run
inside the actor's process and registered with the router. Ray places and restarts replicas; the router
sends them traffic. Session streams never pass through Ray (Ray Serve's gRPC ingress carries
bidirectional streams only as a beta, one hop more per message)."""

from __future__ import annotations

from dataclasses import replace

from specedge.cloud.config import ServerConfig
from specedge.cloud.server import advertised_address


class VerifierReplica:
    def __init__(self, config: ServerConfig) -> None:
        from specedge.cloud.launch import EmbeddedVerifier

        if config.host == "0.0.0.0" and not config.advertise:
            import ray

            config = replace(config, advertise=ray.util.get_node_ip_address())  # and the port it binds
        self.verifier = EmbeddedVerifier(config)
        self.address = advertised_address(config, self.verifier.port)

    def target(self) -> str:
        """Where the router reaches it."""
        return self.address

    def sessions(self) -> int:
        return sum(self.verifier.service.sessions_by_client.values())

    def drain(self, grace_s: float = 30.0) -> None:
        """Leave the router, move the live sessions to other replicas, stop serving."""
        self.verifier.stop(grace_s)
