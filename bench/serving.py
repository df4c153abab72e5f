"""`specedge bench` over gRPC: N concurrent edge clients against one verifier on loopback.

Each (concurrency, rtt) level runs every method on the same jobs: `server-ar` (clients call Generate, the
verifier decodes with continuous batching) and each drafter (clients draft, the verifier batches the
trees of all sessions). Aggregate tokens/s is all tokens over the level's wall time. The round trip is
emulated in the client (half before each request, half after the answer). Clients are threads of this
process; the verifier is `specedge serve` in a child process, as deployed (sharing this process's GIL
with sixteen clients would slow its engine thread), started afresh for every measurement so that no
method finds another's prompts in the prefix cache. With `--server HOST:PORT` the clients go to a running
verifier or router instead (a deployed cluster: the compose file's edge service); its prefix cache then
carries over from method to method, and its KV figures are not read. With `--netem delay_ms=...` the
clients reach the verifier through the network-emulating proxy (netem/proxy.py) instead of emulating the
round trip themselves.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult


class DelayedSession:
    """Adds an emulated network round trip to every step of a session."""

    def __init__(self, session, rtt_ms: float) -> None:
        self.session, self.half = session, rtt_ms / 2e3
        self.vocab_size, self.prompt_ids, self.params = session.vocab_size, session.prompt_ids, session.params
        self.max_tree_tokens = session.max_tree_tokens

    def step(self, tree: DraftTree) -> StepResult:
        time.sleep(self.half)
        result = self.session.step(tree)
        time.sleep(self.half)
        result.rtt_ms += 2e3 * self.half
        return result

    def cost_model(self):
        return self.session.cost_model()

    def close(self) -> None:
        self.session.close()


@dataclass
class JobResult:
    prompt: int
    tokens: list[int]
    rounds: int | None
    draft_ms: list[float]
    tree_sizes: list[int]


def run_level(verifier_target: str, method: str, jobs: list[list[int]], concurrency: int, rtt_ms: float,
              max_new_tokens: int, eos: list[int], make_drafter, max_tree: int) -> tuple[list[JobResult], float]:
    """All jobs through `concurrency` client threads -> (results, wall seconds)."""
    from specedge.edge.controller import TreeSizeController
    from specedge.edge.generation import generate
    from specedge.edge.transport import RemoteVerifier

    params = SamplingParams(max_new_tokens=max_new_tokens)
    results: list[JobResult] = []
    lock = threading.Lock()
    next_job = iter(range(len(jobs)))
    errors: list[BaseException] = []

    def worker() -> None:
        verifier = RemoteVerifier(verifier_target)
        drafter = make_drafter() if method != "server-ar" else None
        controller = TreeSizeController(max_tree)
        try:
            while True:
                with lock:
                    i = next(next_job, None)
                if i is None:
                    return
                if method == "server-ar":
                    time.sleep(rtt_ms / 1e3)  # the request goes out, the first tokens come back
                    tokens = [t for chunk in verifier.server_generate(jobs[i], params) for t in chunk]
                    r = JobResult(i, tokens, None, [], [])
                else:
                    session = DelayedSession(verifier.open(jobs[i], params), rtt_ms)
                    g = generate(session, eos, drafter, controller if drafter is not None else None)
                    r = JobResult(i, g.token_ids, g.rounds, g.draft_ms, g.tree_sizes)
                with lock:
                    results.append(r)
        except BaseException as e:  # reported by the caller
            errors.append(e)
        finally:
            verifier.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: r.prompt), wall


@dataclass
class RunningVerifier:
    """A verifier (or router) started elsewhere: `--server`."""

    target: str

    def metric(self, name: str) -> float | None:
        return None


def serving_rows(args, prompts, encoded, eos: list[int], check) -> list[dict]:
    """Rows for every (method, concurrency, rtt) level; `check(method, prompt, ids, want, got)` raises on a
    greedy mismatch."""
    from specedge.edge.registry import make_drafter
    from specedge.edge.transport import RemoteVerifier

    levels = [int(c) for c in str(args.concurrency).split(",")]
    rtts = [float(r) for r in str(args.rtt_ms).split(",")]
    drafters = [d for d in args.drafters.split(",") if d]
    methods = ["server-ar", *drafters]
    rows = []
    serve_args = ["--model", args.model, "--kv-pool-mb", str(args.kv_pool_mb), "--max-batch-tokens",
                  str(args.max_batch_tokens), "--max-tree-tokens", str(max(args.max_tree, 1)),
                  "--max-sessions-per-client", "1024", "--grace-s", "0"]
    warm_up = SamplingParams(max_new_tokens=8)
    for concurrency in levels:
        jobs = [encoded[i % len(encoded)] for i in range(max(len(encoded), concurrency))]
        for rtt in rtts:
            per_method: dict[str, list[tuple[float, float, list[JobResult]]]] = {m: [] for m in methods}
            for rep in range(args.reps):
                for method in methods:
                    with _verifier(args, serve_args) as verifier:
                        warm = RemoteVerifier(verifier.target)
                        list(warm.server_generate(jobs[0][:32], warm_up))  # first-step allocations, untimed
                        warm.close()
                        results, wall = run_level(
                            verifier.target, method, jobs, concurrency, rtt, args.max_new_tokens, eos,
                            lambda: make_drafter(method, None, max_nodes=args.max_tree), args.max_tree)
                        peak = verifier.metric("specedge_kv_peak_bytes")
                    per_method[method].append((sum(len(r.tokens) for r in results) / wall, peak, results))
                    kv = "" if peak is None else f", KV peak {peak / 2**20:.1f} MiB"
                    print(f"[serving] concurrency {concurrency} rtt {rtt:g} ms rep {rep + 1} {method}: "
                          f"{per_method[method][-1][0]:.1f} tokens/s{kv}", flush=True)
            reference = {r.prompt: r.tokens for r in per_method["server-ar"][0][2]}
            for method in drafters:
                for _, _, results in per_method[method]:
                    for r in results:
                        if r.tokens != reference[r.prompt]:
                            p = prompts[r.prompt % len(prompts)]
                            check(method, p, jobs[r.prompt], reference[r.prompt], r.tokens)
            base = [tps for tps, _, _ in per_method["server-ar"]]
            for method in methods:
                runs = per_method[method]
                every = [r for _, _, results in runs for r in results]
                rounds = [r.rounds for r in every if r.rounds]
                drafts = [ms for r in every for ms in r.draft_ms]
                sizes = [s for r in every for s in r.tree_sizes]
                rows.append({
                    "method": method, "category": "all", "n_prompts": len(jobs), "concurrency": concurrency,
                    "rtt_ms": rtt, "tokens_per_s": round(statistics.median(t for t, _, _ in runs), 3),
                    "speedup": round(statistics.median(t / b for (t, _, _), b in zip(runs, base)), 3),
                    "mean_accepted": round(sum(len(r.tokens) for r in every if r.rounds) / sum(rounds), 3)
                    if rounds else None,
                    "draft_ms": round(statistics.median(drafts), 3) if drafts else None,
                    "tree_size": round(statistics.mean(sizes), 2) if sizes else None,
                    "kv_peak_bytes": None if runs[0][1] is None else int(max(peak for _, peak, _ in runs)),
                    "baseline": "server-ar", "reps": args.reps,
                })
    return rows


@contextlib.contextmanager
def _verifier(args, serve_args: list[str]):
    """The verifier to measure against; behind an emulated network (`--netem`) when asked."""
    if args.server:
        verifier = contextlib.nullcontext(RunningVerifier(args.server))
    else:
        from specedge.cloud.launch import VerifierProcess

        verifier = VerifierProcess(*serve_args)
    with verifier as v:
        if not args.netem:
            yield v
            return
        from specedge.netem.proxy import EmbeddedProxy, parse_conditions

        with EmbeddedProxy(v.target, parse_conditions(args.netem)) as link:
            yield _Behind(v, link.target)


@dataclass
class _Behind:
    """A verifier reached through a proxy: the proxy's address, the verifier's metrics."""

    verifier: object
    target: str

    def metric(self, name: str):
        return self.verifier.metric(name)
