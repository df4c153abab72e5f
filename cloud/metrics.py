"""Prometheus metrics of a verifier (served over HTTP on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.scheduler import StepStats


class VerifierMetrics:
    def __init__(self, pool: KVBlockPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pool = pool
        self.sessions = Gauge("specedge_sessions_active", "open sessions (Session and Generate)", registry=r)
        self.sessions_total = Counter("specedge_sessions", "sessions opened", ["rpc"], registry=r)
        self.batch_sessions = Histogram("specedge_batch_sessions", "sessions per engine step",
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.step_tokens = Histogram("specedge_step_tokens", "tokens per engine step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), registry=r)
        self.step_seconds = Histogram("specedge_step_seconds", "engine step latency", registry=r,
                                      buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5))
        self.accepted = Histogram("specedge_committed_tokens_per_verdict", "tokens committed per verdict",
                                  buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.prompt_tokens = Counter("specedge_prompt_tokens", "prompt tokens of opened sessions, by whether their "
                                     "KV came from the prefix cache", ["source"], registry=r)
        self.errors = Counter("specedge_rpc_errors", "RPCs ended with an error status", ["code"], registry=r)
        # Read from the pool at each scrape: a session's blocks show as released as soon as they are, not at
        # the next engine step (which may never come on an idle verifier).
        self.kv_blocks = Gauge("specedge_kv_blocks", "KV pool blocks by state", ["state"], registry=r)
        for state in ("used", "cached", "free"):
            self.kv_blocks.labels(state).set_function(lambda state=state: getattr(pool.stats(), state))
        self.kv_peak_bytes = Gauge("specedge_kv_peak_bytes", "most KV bytes in use at once", registry=r)
        self.kv_peak_bytes.set_function(lambda: pool.peak_used * pool.bytes_per_block)

    def on_step(self, s: StepStats) -> None:
        self.batch_sessions.observe(s.sessions)
        self.step_tokens.observe(s.tokens)
        self.step_seconds.observe(s.ms / 1e3)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
