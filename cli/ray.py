"""`specedge ray`: verifier replicas as Ray actors behind a router (cloud/ray/). `up` starts the fleet
(on RAY_ADDRESS's cluster, or a local Ray instance) and keeps it until interrupted, autoscaling if asked;
`scale N` and `status` reach it from another shell."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

from specedge.cloud.config import DEFAULT_MODEL, ServerConfig


# ServerConfig fields `ray up` passes to every replica as they are: how it is reached and whom it trusts.
REPLICA_SETTINGS = ("auth_token", "trusted_relays", "tls_cert", "tls_key", "tls_client_ca", "register_tls_ca")


def add_parser(commands) -> None:
    r = commands.add_parser("ray", help="run verifier replicas on a Ray cluster",
                            description="Verifier replicas as Ray actors, each a normal gRPC verifier that "
                            "registers with a router (`specedge router`); Ray places and restarts them, the "
                            "router sends them traffic.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    actions = r.add_subparsers(dest="action", metavar="ACTION", required=True, help="what to do")
    up = actions.add_parser("up", help="start the replicas and keep them (Ctrl-C drains and stops them)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    up.add_argument("--replicas", type=int, default=2, help="replicas to start with")
    up.add_argument("--router", required=True, help="router the replicas register with, host:port")
    up.add_argument("--model", default=DEFAULT_MODEL, help="registry name or local Hugging Face model dir")
    up.add_argument("--host", default="127.0.0.1", help="address replicas listen on (0.0.0.0 on a multi-node "
                    "cluster: they then advertise their node's IP)")
    up.add_argument("--kv-pool-mb", type=int, default=ServerConfig.kv_pool_mb, help="KV budget per replica")
    for name in REPLICA_SETTINGS:
        flag, field = "--" + name.replace("_", "-"), ServerConfig.__dataclass_fields__[name]
        where = " (a file at the same path on every node)" if "tls" in name else ""
        up.add_argument(flag, default=field.default, help=f"each replica's {flag}: {field.metadata['help']}{where}")
    up.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica (also its engine threads)")
    up.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    up.add_argument("--autoscale-max", type=int, default=0, help="autoscale up to this many replicas (0 = off)")
    up.add_argument("--autoscale-min", type=int, default=1, help="autoscale down to this many")
    up.add_argument("--target-sessions", type=float, default=8.0, help="autoscale: sessions per replica wanted")
    up.add_argument("--up-delay-s", type=float, default=10.0, help="autoscale: a higher want must hold this long")
    up.add_argument("--down-delay-s", type=float, default=60.0, help="autoscale: a lower want must hold this long")
    up.set_defaults(run=run_up)
    scale = actions.add_parser("scale", help="change the replica count of a running `ray up` (removed "
                               "replicas drain first: their sessions move)")
    scale.add_argument("replicas", type=int, help="the new count")
    scale.set_defaults(run=run_scale)
    status = actions.add_parser("status", help="the replicas of a running `ray up` and their sessions")
    status.set_defaults(run=run_status)


def replica_config(args: argparse.Namespace) -> ServerConfig:
    """What each replica serves with, from `ray up`'s flags (ValueError for TLS files that cannot work)."""
    from specedge.cloud.server import check_tls

    config = ServerConfig(model=args.model, host=args.host, port=0, kv_pool_mb=args.kv_pool_mb,
                          register=args.router, threads=max(1, int(args.num_cpus)),
                          **{name: getattr(args, name) for name in REPLICA_SETTINGS})
    check_tls(config)
    return config


def run_up(args: argparse.Namespace) -> int:
    try:
        config = replica_config(args)
    except ValueError as e:
        raise SystemExit(f"specedge ray up: {e}")
    import ray

    from specedge.cloud.ray.autoscale import Autoscaler
    from specedge.cloud.ray.controller import start_controller

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    autoscaler = None
    if args.autoscale_max:
        autoscaler = Autoscaler(args.autoscale_min, args.autoscale_max, args.target_sessions, args.up_delay_s,
                                args.down_delay_s)
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace="specedge", include_dashboard=False,
             logging_level=logging.WARNING)
    controller = start_controller(config, args.num_cpus, args.num_gpus, autoscaler)
    addresses = ray.get(controller.scale.remote(args.replicas))
    print(f"{len(addresses)} replicas serving: {', '.join(addresses)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if autoscaler is not None:
            ray.get(controller.autoscale.remote(time.monotonic()))
    ray.get(controller.shutdown.remote())
    return 0


def _controller():
    import ray

    from specedge.cloud.ray.controller import find_controller

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace="specedge", logging_level=logging.WARNING)
    try:
        return find_controller()
    except ValueError:
        raise SystemExit("specedge ray: no `specedge ray up` is running on this Ray cluster")


def run_scale(args: argparse.Namespace) -> int:
    import ray

    addresses = ray.get(_controller().scale.remote(args.replicas))
    print(f"{len(addresses)} replicas serving: {', '.join(addresses)}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    import ray

    for address, sessions in ray.get(_controller().status.remote()):
        print(f"{address}\tsessions={sessions}")
    return 0
