"""Where a served round's time goes besides the engine's pass: one client on loopback gRPC, greedy rounds of
empty trees against a verifier in a child process (its own interpreter and GIL, as deployed; engine steps on
its main thread, as `specedge serve` runs them), each leg timed by one clock (BENCHMARKS.md section 9).

    .venv/bin/python bench/round_split.py --model smollm2-135m --rounds 150 --pin 0,1

Legs (medians over the rounds after the first 20): the client's send until the server has parsed the tree;
until the scheduler has the request; until the engine's step starts (the scheduler's wait); the step; from the
step's end until the server has built the verdict; until the client has it. The server's marks are set by
wrapping the service's and scheduler's own methods, so what this measures is the served path itself; both
processes read `time.perf_counter`, one system-wide monotonic clock on Linux. Last, the verifier's CPU time
a round outside its steps (every thread's: gRPC, the event loop, the scheduler; the step's is its thread's,
so on a CPU pin the verifier to one core, where the engine runs one thread): what each session's round costs
the host, which the sessions of a batched step multiply (`--generate`: the same for a token of server-side
decoding).

`--shape NAME` serves random weights of a bench/gpu_bench.py shape (for a GPU machine, which has no weights);
`--floor-ms H` serves from a bare gRPC server instead that holds each round H ms: what gRPC alone costs
between the two processes with that pause between rounds (`outside the hold`). `--tls tls|mutual` makes a
CA and certificates (bench/certs.py) and serves TLS or mutual TLS, the client presenting its certificate in
the second: what encryption adds to a round and to the verifier's CPU. `--clients N` (N > 1): N clients at
once, each on its own connection, their rounds batched into the verifier's steps; reported is then only the
verifier's CPU outside its steps, per session round (and per token of N concurrent `Generate` streams), and
the sessions a step held: what a host pays per session when it serves many.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

LEGS = ("send -> parsed", "parsed -> submitted", "submitted -> step", "step", "step -> verdict built",
        "verdict built -> client")


def serving_tls(args) -> tuple[str | None, str | None, str | None]:
    """The child's certificate, key and client CA (None where plaintext, or no client CA)."""
    if args.tls == "plain":
        return None, None, None
    d = Path(args.tls_dir)
    return str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem") if args.tls == "mutual" else None


def client_channel(args):
    from specedge.edge.transport import ChannelConfig

    if args.tls == "plain":
        return ChannelConfig()
    d = Path(args.tls_dir)
    mutual = args.tls == "mutual"
    return ChannelConfig(tls_ca=str(d / "ca.pem"), tls_cert=str(d / "client.pem") if mutual else None,
                         tls_key=str(d / "client.key") if mutual else None)


def timed(marks: list[float], fn):
    def wrapper(*args, **kwargs):
        marks.append(time.perf_counter())
        return fn(*args, **kwargs)
    return wrapper


def serve(args) -> None:
    """The child: a verifier whose methods leave marks; prints its address, serves until stdin closes, printing
    the marks as JSON for every line read."""
    from specedge.cloud.config import ServerConfig
    from specedge.cloud.launch import EmbeddedVerifier

    cert, key, client_ca = serving_tls(args)
    config = ServerConfig(model=args.model, port=0, max_new_tokens=args.rounds + 8, device=args.device,
                          dtype=args.dtype, compile=args.compile, tls_cert=cert, tls_key=key, tls_client_ca=client_ca)
    hf_and_tokenizer = None
    if args.shape:  # random weights of a real architecture, served by token ids (a GPU machine has no weights)
        from specedge.bench.gpu_bench import random_model
        from specedge.cloud.device import engine_device

        hf_and_tokenizer = random_model(args.shape, *engine_device(args.device, args.dtype)), None
    verifier = EmbeddedVerifier(config, hf_and_tokenizer, scheduler_thread=False)
    service, scheduler = verifier.service, verifier.service.scheduler
    marks: dict[str, list[float]] = defaultdict(list)
    service._tree = timed(marks["parsed"], service._tree)  # every tree, the open's included
    scheduler.verify = timed(marks["submitted"], scheduler.verify)  # every tree but the open's
    service._verdict = timed(marks["verdict built"], service._verdict)  # once the handler has the answer
    step = scheduler.engine.step

    def timed_step(*a, **k):
        marks["step"].append(time.perf_counter())
        cpu = time.thread_time()
        try:
            return step(*a, **k)
        finally:
            marks["step end"].append(time.perf_counter())
            marks["step cpu"].append(time.thread_time() - cpu)

    scheduler.engine.step = timed_step
    print(verifier.target, flush=True)

    def until_told() -> None:
        since = time.process_time()
        for _ in sys.stdin:
            marks["process cpu"] = [time.process_time() - since]  # every thread's, since the last report
            print(json.dumps(marks), flush=True)
            for m in marks.values():
                m.clear()
            since = time.process_time()

    verifier.run_engine_while(until_told)
    verifier.stop()


def serve_floor(hold_ms: float, tls_files: tuple[str | None, str | None, str | None]) -> None:
    """The child of `--floor-ms`: a bare gRPC server (none of the service, scheduler or engine) that answers each
    tree with the same verdict after holding its core `hold_ms`, as a step would: what loopback gRPC between
    these processes costs with the same pause between rounds."""
    import asyncio

    import grpc

    from specedge.common import tls, wire
    from specedge.common.cost_model import CostModel
    from specedge.protos import verifier_pb2 as pb

    cost = wire.cost_to_pb(CostModel(((0, hold_ms), (64, hold_ms))), 1)
    verdict = pb.Verdict(tokens=[7], compute_ms=hold_ms, next_max_tree_tokens=64, cost=cost)
    info = pb.VerifierInfo(model="floor", vocab_size=1024, limits=pb.Limits(max_tree_tokens=64), cost=cost)

    async def session(requests, context):
        async for raw in requests:
            request = pb.SessionRequest.FromString(raw)
            if request.WhichOneof("kind") == "close":
                return
            held = time.perf_counter() + hold_ms / 1e3
            while time.perf_counter() < held:
                pass
            if request.WhichOneof("kind") == "open":
                yield pb.SessionResponse(opened=pb.Opened(verdict=verdict)).SerializeToString()
            else:
                yield pb.SessionResponse(verdict=verdict).SerializeToString()

    async def get_info(raw, context):
        return info.SerializeToString()

    async def run() -> None:
        server = grpc.aio.server()
        handlers = {"Session": grpc.stream_stream_rpc_method_handler(session),
                    "GetInfo": grpc.unary_unary_rpc_method_handler(get_info)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specedge.v1.Verifier", handlers),))
        port = tls.add_port(server, "127.0.0.1:0", *tls_files)
        await server.start()
        print(f"127.0.0.1:{port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        await server.stop(None)

    asyncio.run(run())


def ask_marks(child: subprocess.Popen) -> dict[str, list[float]]:
    """The child's marks since it was last asked."""
    child.stdin.write("marks\n")
    child.stdin.flush()
    return json.loads(child.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shape", default="", help="serve random weights of this bench/gpu_bench.py shape instead")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pin", default="", help="CLIENT,VERIFIER: the core of each process (default: unpinned)")
    ap.add_argument("--floor-ms", type=float, default=0.0,
                    help="serve from a bare gRPC server that holds each round this long instead (see serve_floor)")
    ap.add_argument("--generate", action="store_true", help="also the verifier's CPU a token of server-side "
                    "decoding (the Generate RPC), outside its steps")
    ap.add_argument("--clients", type=int, default=1, help="clients at once (> 1: the verifier's CPU only)")
    ap.add_argument("--tls", choices=("plain", "tls", "mutual"), default="plain",
                    help="serve plaintext, TLS, or mutual TLS (certificates made for the run)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child's role
    ap.add_argument("--tls-dir", default="", help=argparse.SUPPRESS)  # the child's: where the certificates are
    args = ap.parse_args()
    if args.serve:
        return serve_floor(args.floor_ms, serving_tls(args)) if args.floor_ms else serve(args)
    with tempfile.TemporaryDirectory() as tls_dir:
        if args.tls != "plain":
            from specedge.bench.certs import make_certs

            make_certs(Path(tls_dir), ("server", "client"))
        args.tls_dir = tls_dir
        measure(args)


def measure(args) -> None:
    from specedge.common.draft_tree import DraftTree
    from specedge.common.params import SamplingParams
    from specedge.edge.transport import RemoteVerifier

    client_cpu, verifier_cpu = (int(c) for c in args.pin.split(",")) if args.pin else (None, None)
    pin = None if verifier_cpu is None else lambda: os.sched_setaffinity(0, {verifier_cpu})
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--tls-dir", args.tls_dir, *sys.argv[1:]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})
    try:
        target = child.stdout.readline().strip()
        if args.clients > 1:
            return measure_many(args, child, target)
        prompt = list(range(100, 164))
        for rep in range(args.reps):
            verifier = RemoteVerifier(target, client_channel(args))
            session = verifier.open(prompt, SamplingParams(max_new_tokens=args.rounds + 4))
            sent, got, held = [], [], []
            for _ in range(args.rounds):
                sent.append(time.perf_counter())
                held.append(session.step(DraftTree.empty()).compute_ms)
                got.append(time.perf_counter())
            session.close()
            legs = defaultdict(list)
            if args.floor_ms:
                for i in range(20, args.rounds):
                    legs["outside the hold"].append((got[i] - sent[i]) * 1e3 - held[i])
            else:
                marks = ask_marks(child)
                for i in range(20, args.rounds):  # round i: the i-th tree (0: the open's)
                    at = [sent[i], marks["parsed"][i], marks["submitted"][i - 1], marks["step"][i],
                          marks["step end"][i], marks["verdict built"][i], got[i]]
                    for leg, (a, b) in zip(LEGS, zip(at, at[1:])):
                        legs[leg].append((b - a) * 1e3)
                    legs["outside the step"].append((got[i] - sent[i] - at[4] + at[3]) * 1e3)
                # CPU time, not a median: the whole repetition's, the open and the close included
                outside = marks["process cpu"][0] - sum(marks["step cpu"])
                legs["verifier CPU outside the step"] = [outside / args.rounds * 1e3]
                if args.generate:
                    produced = sum(len(t) for t in verifier.server_generate(prompt, SamplingParams(
                        max_new_tokens=args.rounds)))
                    marks = ask_marks(child)
                    outside = marks["process cpu"][0] - sum(marks["step cpu"])
                    legs["Generate: verifier CPU outside the step a token"] = [outside / produced * 1e3]
            verifier.close()
            print(f"rep {rep}: " + ", ".join(f"{leg} {statistics.median(v):.2f}" for leg, v in legs.items()) + " ms",
                  flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def measure_many(args, child: subprocess.Popen, target: str) -> None:
    """`--clients N`: N clients' rounds (then N Generate streams) at once; the verifier's CPU outside its steps
    per session round (per token), and the sessions per step."""
    from specedge.common.draft_tree import DraftTree
    from specedge.common.params import SamplingParams
    from specedge.edge.transport import RemoteVerifier

    def at_once(work) -> list:
        results: list = [None] * args.clients
        ready = threading.Barrier(args.clients)

        def run(k: int) -> None:
            verifier = RemoteVerifier(target, client_channel(args))
            prompt = [100 + k, *range(101, 164)]  # a prompt of each client's own: no shared prefix
            ready.wait()
            results[k] = work(verifier, prompt)
            verifier.close()

        threads = [threading.Thread(target=run, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def rounds(verifier, prompt) -> int:
        session = verifier.open(prompt, SamplingParams(max_new_tokens=args.rounds + 4))
        for _ in range(args.rounds):
            session.step(DraftTree.empty())
        session.close()
        return args.rounds

    def decoded(verifier, prompt) -> int:
        return sum(len(t) for t in verifier.server_generate(prompt, SamplingParams(max_new_tokens=args.rounds)))

    ask_marks(child)  # what the child did while starting is left out
    for rep in range(args.reps):
        parts = []
        for what, work in [("a session round", rounds), ("a Generate token", decoded)][: 1 + args.generate]:
            start = time.perf_counter()
            done = sum(at_once(work))
            wall = time.perf_counter() - start
            marks = ask_marks(child)
            outside = marks["process cpu"][0] - sum(marks["step cpu"])
            parts.append(f"verifier CPU outside the step {what} {outside / done * 1e3:.2f} ms "
                         f"({done / len(marks['step']):.1f} sessions a step, {done / wall:.0f} a second)")
        print(f"rep {rep}, {args.clients} clients: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
