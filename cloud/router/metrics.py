"""Prometheus metrics of a router (served over HTTP on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.placements = Counter("specedge_router_placements", "sessions placed, by verifier and reason "
                                  "(affinity, load, round-robin)", ["verifier", "reason"], registry=r)
        self.prompt_tokens = Counter("specedge_router_prompt_tokens", "prompt tokens of placed sessions", registry=r)
        self.cached_tokens = Counter("specedge_router_cached_prompt_tokens", "prompt tokens the chosen verifier "
                                     "held in its prefix cache at placement (hit rate = this / prompt tokens)",
                                     registry=r)
        self.relay_failures = Counter("specedge_router_relay_failures", "calls to a verifier that failed as if it "
                                      "were down (the session is placed again)", ["verifier"], registry=r)
        self.refused = Counter("specedge_router_refused_sessions", "sessions refused by the router's per-client "
                               "limits", registry=r)
        self.verifiers = Gauge("specedge_router_verifiers", "known verifiers, in the pool or not", ["state"],
                               registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
