"""A verifier's configuration: every setting with its default and its meaning, in one place. `specedge serve`
builds its flags from these fields (cli/serve.py), so a default is never written twice."""

from __future__ import annotations

from dataclasses import dataclass, field

from specedge.common.hints import DEFAULT_HINTS_TOP_K

DEFAULT_MODEL = "smollm2-135m"


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ServerConfig:
    model: str = _setting(DEFAULT_MODEL, "registry name (smollm2-135m, gemma3-270m) or a local Hugging Face "
                          "model directory")
    host: str = _setting("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _setting(50051, "gRPC port (0 = any free port)")
    device: str = _setting("auto", "where the engine runs: cuda, cpu, or auto (cuda when a GPU is visible)")
    dtype: str = _setting("auto", "the model's and KV pool's number format: float32, bfloat16, float16, or auto "
                          "(bfloat16 on a GPU, float32 on the CPU)")
    compile: str = _setting("auto", "torch.compile each layer's dense parts (fused kernels): on, off, or auto (on "
                            "with a GPU, where passes cost about a fifth less; the first steps take seconds longer "
                            "while it compiles)")
    kv_pool_mb: int = _setting(256, "KV cache budget in MiB, allocated at start")
    max_batch_tokens: int = _setting(2048, "tokens per engine step across sessions; drafts are trimmed to stay "
                                     "within it, and a longer prompt is prefilled in chunks over several steps")
    max_prompt_tokens: int = _setting(8192, "longest prompt accepted")
    max_tree_tokens: int = _setting(128, "largest draft tree accepted per round (clients read it at connect)")
    max_new_tokens: int = _setting(4096, "most tokens one session may generate")
    max_hints_top_k: int = _setting(DEFAULT_HINTS_TOP_K, "most hint tokens per verified position a session may ask "
                                    "for (the target's own top-k, which edges draft from); 0 = no hints")
    max_sessions_per_client: int = _setting(64, "open sessions per client identity (a client certificate's name, "
                                            "an --auth-tokens name, else the client's IP address); 0 = no limit")
    max_tokens_per_client: int = _setting(0, "tokens (prompt + max_new_tokens) a client's open sessions may "
                                          "claim together; 0 = no limit")
    warm_drafter_clients: int = _setting(256, "clients whose verifier-side drafting state (acceptance "
                                         "model, earlier outputs) is kept for their next sessions, the least "
                                         "recently served forgotten first (up to 1.7 MiB each); 0 = every "
                                         "session's starts fresh")
    idle_timeout_s: float = _setting(300.0, "close sessions idle this long")
    auth_token: str | None = _setting(None, "require `authorization: Bearer TOKEN` metadata (one token shared by "
                                      "all clients; with --auth-tokens, either is accepted)")
    auth_tokens: str | None = _setting(None, "file of `NAME TOKEN` lines: each client's own bearer token; its NAME is "
                                       "the identity its per-client limits count against")
    trusted_relays: str = _setting("", "identities allowed to speak for their clients (comma-separated, e.g. "
                                   "token:router): a router relaying sessions passes each client's identity on")
    tls_cert: str | None = _setting(None, "PEM certificate: serve TLS (with --tls-key)")
    tls_key: str | None = _setting(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = _setting(None, "PEM CA: require client certificates it signed (mutual TLS)")
    metrics_port: int | None = _setting(None, "serve Prometheus metrics over HTTP here")
    gather_ms: float = _setting(2.0, "how long an idle verifier's first step waits for more sessions' work")
    admission_timeout_s: float = _setting(30.0, "refuse a prompt waiting for KV blocks once no session has "
                                          "given blocks back for this long")
    grace_s: float = _setting(30.0, "on SIGTERM, let open sessions finish (or move, with --register) this long")
    threads: int = _setting(0, "CPU threads of the engine (0 = torch's default, one per core); give each of several "
                            "verifiers on one machine its share, or their thread pools fight over the cores")
    register: str | None = _setting(None, "router (host:port) to join with a lease renewed by heartbeat; SIGTERM "
                                    "then moves live sessions to other verifiers instead of waiting for them")
    advertise: str | None = _setting(None, "host:port (or host: then the bound port) the router reaches this "
                                     "verifier at (default: --host and the bound port)")
    register_tls_ca: str | None = _setting(None, "PEM CA of the router's certificate: --register over TLS, "
                                           "presenting --tls-cert as this verifier's client certificate (for a "
                                           "router with --tls-client-ca)")
