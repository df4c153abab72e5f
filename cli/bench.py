"""`specedge bench`: the command's flags; the harness is bench/harness.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from specedge.cli.flags import add_tls_flags
from specedge.cloud.config import DEFAULT_MODEL, ServerConfig
from specedge.common.tree_sizing import MAX_TREE_NODES


def add_parser(commands) -> None:
    from specedge.bench.harness import BASELINES

    b = commands.add_parser(
        "bench",
        help="measure drafters and baselines side by side",
        description="Measure speculative methods against plain decoding on the same prompts in one run "
        "(interleaved, several repetitions, medians). Writes results.json, results.md and plots to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--model", default=DEFAULT_MODEL, help="registry name or local Hugging Face model dir")
    b.add_argument("--workload", default=None, metavar="specbench:CAT,...",
                   help="Spec-Bench categories (e.g. specbench:summarization,rag; specbench:all for every one), or "
                   "shared-doc:N (N prompts with one ~1,400-token document in common and different questions)")
    b.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help="prompts file: lines with id, category, prompt (or Spec-Bench lines with turns)")
    b.add_argument("--per-category", type=int, default=6, help="prompts per category (Spec-Bench workloads)")
    b.add_argument("--drafters", default="retrieval", help="comma-separated drafters to measure: retrieval, "
                   "model:NAME, hybrid[:NAME]; in gRPC mode also mix:A+B+... (client k drafts with the k-th, "
                   "round robin: heterogeneous clients on one verifier)")
    b.add_argument("--drafting-model", default="smollm2-135m",
                   help="the assistant of the hf-uag baseline (transformers' universal assisted generation)")
    b.add_argument("--baselines", default="ar,hf-pld,suffix,oracle",
                   help=f"comma-separated baselines from {', '.join(BASELINES)}; ar is always run")
    b.add_argument("--corpus", action="append", type=Path, default=[], metavar="PATH",
                   help="long-term datastore (files, dirs or a built datastore): each drafter then also runs "
                   "as DRAFTER+corpus with it, beside the plain DRAFTER")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    b.add_argument("--max-tree", type=int, default=MAX_TREE_NODES, help="most draft nodes per pass")
    b.add_argument("--oracle-depth", type=int, default=16, help="draft length of the oracle baseline")
    b.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    b.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    b.add_argument("--rtt-ms", default="0", help="emulated network round trips, comma-separated (gRPC mode): the "
                   "clients reach the verifier through the network-emulating proxy, half of it each way")
    b.add_argument("--jitter-ms", type=float, default=0.0,
                   help="gRPC mode: uniform jitter on each one-way delay (at most half the round trip)")
    b.add_argument("--bandwidth-kbps", type=float, default=0.0,
                   help="gRPC mode: link rate each way in kilobits per second (0 = unlimited)")
    b.add_argument("--tree-size", default="adaptive", metavar="adaptive,N,...",
                   help="gRPC mode: how many draft nodes each drafter sends: `adaptive` (the controller's choice) "
                   "and/or fixed sizes; each fixed size N runs as DRAFTER@N beside the others")
    b.add_argument("--overlap", default="on", metavar="on,off",
                   help="gRPC mode: whether drafters may send a tree ahead of the verdict in flight (on: when the "
                   "controller finds it pays); `on,off` also runs each as DRAFTER/serial, never ahead")
    b.add_argument("--fill", default="on", metavar="on,off",
                   help="gRPC mode: whether the verifier may add its own draft to what is left of a tree sent ahead "
                   "once the verdict before it is known (on); `on,off` also runs each as DRAFTER/nofill")
    b.add_argument("--concurrency", default="1",
                   help="concurrent edge clients, comma-separated (e.g. 1,4,16). Anything but 1, a round trip "
                   "or the server-ar baseline runs the gRPC mode: clients against a verifier on loopback")
    b.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="measure against this running verifier or router (gRPC mode, no model loaded here) "
                   "instead of starting a verifier per measurement")
    b.add_argument("--auth-token", default=None, help="bearer token for --server")
    add_tls_flags(b, "--server")
    b.add_argument("--netem", default=None, metavar="delay_ms=20,jitter_ms=5,...",
                   help="gRPC mode: reach the verifier through the network-emulating proxy with these conditions "
                   "(fields of `specedge proxy`: delay_ms, jitter_ms, bandwidth_mbps, reset_probability, ...)")
    b.add_argument("--pin-cores", default=None, metavar="EDGE,VERIFIER",
                   help="gRPC mode with the edge (this process, drafting model included) on core EDGE and the "
                   "verifier on core VERIFIER, one thread each, standing for two machines; transformers' "
                   "baselines (hf-*) then run here on both cores with two threads")
    b.add_argument("--max-batch-tokens", type=int, default=ServerConfig.max_batch_tokens,
                   help="the verifier's per-step token budget (gRPC mode)")
    # Twice a verifier's default: sixteen clients with ~1,000-token prompts need ~300 MiB (BENCHMARKS.md).
    b.add_argument("--kv-pool-mb", type=int, default=512, help="KV cache budget of the engine in MiB")
    b.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specedge.bench.harness import run_bench

    return run_bench(args)
