"""A router's configuration: every setting with its default and meaning, in one place (`specedge router`
builds its flags from these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specedge.cloud.router.placement import POLICIES


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class RouterConfig:
    host: str = _setting("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _setting(50050, "gRPC port (0 = any free port)")
    verifiers: str = _setting("", "static verifiers, host:port,...; others join with `specedge serve --register`")
    policy: str = _setting("affinity", f"placement: {', '.join(POLICIES)}")
    balance_threshold: float = _setting(4.0, "a verifier with a cached prefix loses a session only when its load "
                                        "(sessions + queued requests) exceeds the least-loaded one's by more")
    health_interval_s: float = _setting(0.5, "how often each verifier's gRPC health is checked")
    health_timeout_s: float = _setting(1.0, "a health check unanswered this long takes the verifier out")
    lease_s: float = _setting(3.0, "registered verifiers leave unless they renew within this")
    auth_token: str | None = _setting(None, "require `authorization: Bearer TOKEN` from clients")
    auth_tokens: str | None = _setting(None, "file of `NAME TOKEN` lines: each client's own bearer token; verifiers "
                                       "that trust this router (--trusted-relays) count limits by NAME")
    max_sessions_per_client: int = _setting(0, "open sessions per client identity across all verifiers (a "
                                            "client certificate's name, an --auth-tokens name, else its IP "
                                            "address; each verifier also applies its own limit); 0 = no limit")
    max_tokens_per_client: int = _setting(0, "tokens (prompt + max_new_tokens) a client's open sessions across all "
                                          "verifiers may claim together; 0 = no limit")
    verifier_auth_token: str | None = _setting(None, "bearer token to present to verifiers")
    tls_cert: str | None = _setting(None, "PEM certificate: serve TLS to clients and registering verifiers "
                                    "(with --tls-key)")
    tls_key: str | None = _setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = _setting(None, "PEM CA: require client certificates it signed (mutual TLS); a "
                                         "client's identity is then its certificate's name, passed on to verifiers")
    verifier_tls_ca: str | None = _setting(None, "PEM CA of the verifiers' certificates: reach verifiers over TLS")
    verifier_tls_cert: str | None = _setting(None, "PEM certificate to present to verifiers with --tls-client-ca "
                                             "(with --verifier-tls-key); they may trust it as a relay, cert:NAME")
    verifier_tls_key: str | None = _setting(None, "PEM private key of --verifier-tls-cert")
    verifier_tls_server_name: str | None = _setting(None, "the name the verifiers' certificates hold, where it "
                                                    "differs from the addresses the router dials")
    metrics_port: int | None = _setting(None, "serve Prometheus metrics over HTTP here")
