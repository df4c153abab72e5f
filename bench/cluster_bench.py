"""The cluster's figures (BENCHMARKS.md section 5), all in real processes on loopback with the real model:
`specedge router` and `specedge serve --register` verifiers, edge clients as threads of this process.

  placement   affinity vs round-robin on document conversations (16 clients, 8 documents, 3 turns each,
              KV pools that hold about half the documents each): prompt tokens served from the prefix
              cache, peak KV bytes summed over verifiers, throughput; outputs must be identical
  scaling     1 vs 2 verifiers under the same 16 clients (affinity)
  failover    SIGKILL of the verifier a generation is on -> the next accepted token (median of --reps)
  drain       `router drain` with 8 live sessions on the drained verifier -> it holds none
  hop         per-round latency through the router vs straight to the verifier (1 client, empty drafts)

  python bench/cluster_bench.py --out bench-out/cluster [--only placement,failover,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specedge.bench.workloads import document_conversations
from specedge.cloud.launch import ServiceProcess, VerifierProcess
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.client import EdgeClient
from specedge.edge.transport import RemoteVerifier
from specedge.protos import router_pb2 as rpb

CACHED = 'specedge_prompt_tokens_total{source="cached"}'
COMPUTED = 'specedge_prompt_tokens_total{source="computed"}'


class Cluster:
    def __init__(self, verifiers: int, kv_pool_mb: int, policy: str = "affinity", threads: int | None = None) -> None:
        threads = threads or max(1, (os.cpu_count() or 1) // verifiers)  # by default each its share of the cores
        self.router = ServiceProcess("router", "--policy", policy)
        with ThreadPoolExecutor(verifiers) as pool:
            self.verifiers = list(pool.map(lambda _: VerifierProcess(
                "--kv-pool-mb", str(kv_pool_mb), "--register", self.router.target, "--threads", str(threads),
                "--max-sessions-per-client", "1024"), range(verifiers)))
        deadline = time.monotonic() + 60
        while self.router.metric('specedge_router_verifiers{state="in_pool"}') < verifiers:
            if time.monotonic() > deadline:
                raise TimeoutError("the verifiers did not join the router")
            time.sleep(0.2)

    def total(self, metric: str) -> float:
        return sum(v.metric(metric) for v in self.verifiers if v.alive)

    def holder(self) -> VerifierProcess:
        return next(v for v in self.verifiers if v.alive and v.metric("specedge_sessions_active") > 0)

    def close(self) -> None:
        for v in self.verifiers:
            v.stop(grace_s=2)
        self.router.stop()


def conversations(cluster: Cluster, clients: int, documents: int, turns: int, max_new_tokens: int,
                  stagger_s: float) -> dict:
    """Every client holds a conversation about its document; -> figures and every output."""
    work = document_conversations(documents, clients)
    outputs: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def client(c: int) -> None:
        time.sleep(c * stagger_s)
        edge = EdgeClient(cluster.router.target, drafter="retrieval", client_id=f"client-{c}")
        document, asks = work[c]
        conversation = document
        try:
            for t in range(turns):
                conversation += f"\n\nQuestion: {asks[t]}\nAnswer:"
                result = edge.generate(conversation, max_new_tokens=max_new_tokens)
                outputs[(c, t)] = result.token_ids
                conversation += result.text
        except BaseException as e:
            errors.append(e)
        finally:
            edge.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    cached, computed = cluster.total(CACHED), cluster.total(COMPUTED)
    return {"wall_s": round(wall, 2), "tokens_per_s": round(sum(map(len, outputs.values())) / wall, 1),
            "prompt_tokens": int(cached + computed), "cached_prompt_tokens": int(cached),
            "hit_rate": round(cached / (cached + computed), 3),
            "kv_peak_bytes_sum": int(cluster.total("specedge_kv_peak_bytes")),
            "outputs": {f"{c}/{t}": ids for (c, t), ids in sorted(outputs.items())}}


def placement(args) -> dict:
    rows = {}
    for policy in ("round-robin", "affinity"):
        runs = []
        for rep in range(args.reps):
            cluster = Cluster(2, args.kv_pool_mb, policy)
            try:
                runs.append(conversations(cluster, args.clients, args.documents, args.turns, args.max_new_tokens,
                                          args.stagger_s))
            finally:
                cluster.close()
            print(f"[placement] {policy} rep {rep + 1}: {_brief(runs[-1])}", flush=True)
        rows[policy] = runs
    want = rows["round-robin"][0]["outputs"]
    for policy, runs in rows.items():
        for run in runs:
            assert run.pop("outputs") == want, f"{policy}: outputs differ between runs (must be identical)"
    return rows


def scaling(args) -> dict:
    rows = {}
    for n in (1, 2):
        runs = []
        for rep in range(args.reps):
            cluster = Cluster(n, args.kv_pool_mb * 2 // n)  # the same KV in total
            try:
                run = conversations(cluster, args.clients, args.documents, args.turns, args.max_new_tokens,
                                    args.stagger_s)
                run.pop("outputs")
                runs.append(run)
            finally:
                cluster.close()
            print(f"[scaling] {n} verifier(s) rep {rep + 1}: {_brief(runs[-1])}", flush=True)
        rows[f"{n} verifier(s)"] = runs
    return rows


def failover(args) -> dict:
    """Kill -> next accepted token, with the model loaded on the survivor. Each verifier gets every core (as on
    a machine of its own): after the kill only the survivor computes. Beside it, the survivor's prefill
    of a prompt as long as the replayed one (fresh tokens: no cache), the part of the gap that is compute."""
    cluster = Cluster(2, args.kv_pool_mb, threads=os.cpu_count())
    gaps, prefills = [], []
    try:
        edge = EdgeClient(cluster.router.target, drafter="retrieval")
        document, asks = document_conversations(1, 1)[0]
        for rep in range(args.reps):
            for v in cluster.verifiers:
                if not v.alive:
                    v.start()
                warm = RemoteVerifier(v.target)  # the survivor has served before: first-step allocations done
                list(warm.server_generate(list(range(100, 140)), SamplingParams(max_new_tokens=4)))
                warm.close()
            time.sleep(1.5)  # the restarted verifier registers (its lease renews every second)
            killed_at, after = [], []

            def on_tokens(tokens: list[int]) -> None:
                now = time.perf_counter()
                if killed_at and not after:
                    after.append(now)
                elif not killed_at and len(on_tokens.seen) >= 2:
                    cluster.holder().kill()
                    killed_at.append(time.perf_counter())
                on_tokens.seen.append(now)
                on_tokens.tokens += len(tokens)

            on_tokens.seen, on_tokens.tokens = [], 0
            prompt = f"{document}\n\nQuestion: {asks[rep % len(asks)]}\nAnswer:"
            result = edge.generate(prompt, max_new_tokens=64, on_tokens=on_tokens)
            assert result.resumes == 1 and after, "the kill did not happen mid-generation"
            gaps.append(after[0] - killed_at[0])
            replayed = len(edge.tokenizer.encode(prompt)) + on_tokens.tokens  # about: the prompt + committed
            survivor = next(v for v in cluster.verifiers if v.alive)
            probe = RemoteVerifier(survivor.target).open([(7 * i + rep) % 40000 + 100 for i in range(replayed)],
                                                         SamplingParams(max_new_tokens=1))
            start = time.perf_counter()
            probe.step(DraftTree.empty())
            prefills.append(time.perf_counter() - start)
            probe.close()
            print(f"[failover] rep {rep + 1}: {gaps[-1] * 1e3:.0f} ms from SIGKILL to the next accepted token; "
                  f"a cold prefill of ~{replayed} tokens on the survivor takes {prefills[-1] * 1e3:.0f} ms", flush=True)
        edge.close()
    finally:
        cluster.close()
    return {"kill_to_next_token_ms": [round(g * 1e3) for g in gaps], "median_ms": round(statistics.median(gaps) * 1e3),
            "survivor_prefill_ms": [round(p * 1e3) for p in prefills]}


def drain(args) -> dict:
    cluster = Cluster(2, args.kv_pool_mb)
    results = []
    try:
        work = document_conversations(2, 8)
        for rep in range(args.reps):
            errors, done = [], []
            victim = cluster.verifiers[rep % 2]

            def client(c: int) -> None:
                edge = EdgeClient(victim.target, drafter="retrieval")  # open on the victim itself ...
                edge.close()
                edge = EdgeClient(cluster.router.target, drafter="retrieval")
                try:
                    document, asks = work[c]
                    edge.generate(f"{document}\n\nQuestion: {asks[0]}\nAnswer:", max_new_tokens=160)
                    done.append(c)
                except BaseException as e:
                    errors.append(e)
                finally:
                    edge.close()

            threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while victim.metric("specedge_sessions_active") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            live = victim.metric("specedge_sessions_active")
            with grpc.insecure_channel(cluster.router.target) as channel:
                start = time.perf_counter()
                channel.unary_unary("/specedge.v1.Router/Drain",
                                    request_serializer=rpb.DrainVerifierRequest.SerializeToString,
                                    response_deserializer=rpb.DrainVerifierReply.FromString)(
                    rpb.DrainVerifierRequest(address=victim.target), timeout=30)
                while victim.metric("specedge_sessions_active") > 0:
                    time.sleep(0.01)
                seconds = time.perf_counter() - start
            for t in threads:
                t.join()
            assert not errors, errors[0]
            results.append({"live_sessions": int(live), "drain_s": round(seconds, 3)})
            print(f"[drain] rep {rep + 1}: {int(live)} live sessions moved in {seconds:.2f} s, no client error",
                  flush=True)
            victim.stop()
            victim.start()  # back for the next repetition
            time.sleep(1.5)
    finally:
        cluster.close()
    return {"runs": results, "median_s": statistics.median(r["drain_s"] for r in results)}


def hop(args) -> dict:
    cluster = Cluster(1, args.kv_pool_mb)
    rows = {}
    try:
        prompt = list(range(100, 164))
        for rep in range(args.reps):
            for name, target in (("direct", cluster.verifiers[0].target), ("via router", cluster.router.target)):
                session = RemoteVerifier(target).open(prompt, SamplingParams(max_new_tokens=200))
                session.step(DraftTree.empty())
                times = []
                for _ in range(64):
                    start = time.perf_counter()
                    session.step(DraftTree.empty())
                    times.append((time.perf_counter() - start) * 1e3)
                session.close()
                rows.setdefault(name, []).append(statistics.median(times))
        print(f"[hop] per-round ms: {rows}", flush=True)
    finally:
        cluster.close()
    return {name: round(statistics.median(ms), 2) for name, ms in rows.items()}


def _brief(run: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in run.items() if k != "outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="placement,scaling,failover,drain,hop")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--stagger-s", type=float, default=0.25, help="between client starts")
    parser.add_argument("--kv-pool-mb", type=int, default=256, help="per verifier (~5 documents of SmolLM2 KV)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/cluster"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for part in args.only.split(","):
        results[part] = globals()[part](args)
        (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           **results}, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
