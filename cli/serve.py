"""`specedge serve`: a verifier node."""

from __future__ import annotations

import argparse
import logging


def add_parser(commands) -> None:
    s = commands.add_parser(
        "serve", help="start a verifier (gRPC)",
        description="Serve a model as a specedge verifier: edge clients open sessions, send draft trees and get "
        "the accepted tokens; sessions are batched into shared engine steps over one paged KV pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default="smollm2-135m", help="registry name or local Hugging Face model dir")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    s.add_argument("--kv-pool-mb", type=int, default=256, help="KV cache budget in MiB, allocated at start")
    s.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="tokens per engine step across sessions; drafts are trimmed to stay within it")
    s.add_argument("--max-tree-tokens", type=int, default=128, help="largest draft tree accepted per round")
    s.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt accepted")
    s.add_argument("--max-new-tokens", type=int, default=4096, help="most tokens one session may generate")
    s.add_argument("--max-sessions-per-client", type=int, default=64, help="open sessions per client id")
    s.add_argument("--max-tokens-per-client", type=int, default=0,
                   help="tokens (prompt + max_new_tokens) a client's open sessions may claim together; 0 = no limit")
    s.add_argument("--idle-timeout-s", type=float, default=300.0, help="close sessions idle this long")
    s.add_argument("--auth-token", default=None, help="require `authorization: Bearer TOKEN` metadata")
    s.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (with --tls-key)")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certificates it signed (mTLS)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics over HTTP here")
    s.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, let open sessions finish this long")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.launch import serve_forever
    from specedge.cloud.server import ServerConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("specedge serve: --tls-cert and --tls-key go together")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ServerConfig(
        model=args.model, host=args.host, port=args.port, kv_pool_mb=args.kv_pool_mb,
        max_batch_tokens=args.max_batch_tokens, max_tree_tokens=args.max_tree_tokens,
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
        max_sessions_per_client=args.max_sessions_per_client, max_tokens_per_client=args.max_tokens_per_client,
        idle_timeout_s=args.idle_timeout_s,
        auth_token=args.auth_token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        metrics_port=args.metrics_port)
    try:
        serve_forever(config, args.grace_s)
    except (ValueError, OSError) as e:
        raise SystemExit(f"specedge serve: {e}")
    return 0
