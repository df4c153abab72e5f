"""`specedge bench` over gRPC: N concurrent edge clients against one verifier on loopback.

Each (concurrency, rtt) level runs every method on the same jobs: `server-ar` (clients call Generate, the
verifier decodes with continuous batching) and each drafter (clients draft, the verifier batches the
trees of all sessions). Aggregate tokens/s is all tokens over the level's wall time. A round trip (and
--jitter-ms, --bandwidth-kbps) is a real one: the clients reach the verifier through the network-emulating
proxy (netem/proxy.py), half the round trip each way, so that trees sent ahead of a verdict overlap with it
as they would on a network. Clients are threads of this process; the verifier is `specedge serve` in a
child process, as deployed (sharing this process's GIL with sixteen clients would slow its engine thread).
With one client, all methods of a repetition share one verifier process and take turns prompt by prompt,
its prefix cache flushed before each generation (so that no method finds another's prefill of the
prompt): the speed of a verifier process varies from one to the next by up to ~19% on the benchmark host
(BENCHMARKS.md section 6), as much as the differences between methods in one category. With more clients,
each method gets a fresh verifier, whose KV peak is then the method's own. With `--server HOST:PORT` the
clients go to a running verifier or router instead (a deployed cluster: the compose file's edge service),
one method after the other; its prefix cache then carries over from method to method, and its KV figures
are not read. With `--netem delay_ms=...` the clients reach the verifier through the network-emulating
proxy (netem/proxy.py) instead of emulating the round trip themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specedge.common.params import SamplingParams


@dataclass
class JobResult:
    prompt: int
    tokens: list[int]
    rounds: int | None
    draft_ms: list[float]
    tree_sizes: list[int]
    accepted: list[int] = dataclasses.field(default_factory=list)  # per round, as GenerationResult's
    compute_ms: list[float] = dataclasses.field(default_factory=list)
    queue_ms: list[float] = dataclasses.field(default_factory=list)
    network_ms: list[float] = dataclasses.field(default_factory=list)
    sent_ms: list[float] = dataclasses.field(default_factory=list)  # per round, from the generation's start
    verdict_ms: list[float] = dataclasses.field(default_factory=list)
    ahead: int = 0  # rounds whose tree went out ahead of the verdict before it
    verifier_drafted: int = 0  # committed tokens the verifier drafted itself (trees ahead with nothing left)
    wall_s: float = 0.0
    verifier_s: float | None = None  # the verifier's engine time on this job (one client at a time only)
    passes: int | None = None  # the verifier's engine steps on this job (likewise)


WITHOUT_DRAFTS = ("server-ar", "remote-ar")  # baselines whose clients draft nothing
SERIAL = "/serial"  # a drafter's method name with this suffix never sends a tree ahead of a verdict
NOFILL = "/nofill"  # ... or with this one, never lets the verifier draft a tree ahead with nothing left


def split_method(method: str) -> tuple[str, int | None, bool, bool]:
    """"retrieval@8/serial" -> ("retrieval", 8, False, True): the drafter, its fixed tree size (None:
    adaptive), whether trees may go out ahead of the verdict in flight (the default; the controller decides),
    and whether the verifier may draft such a tree where nothing of it is left (the default)."""
    overlap, fill = not method.endswith(SERIAL), not method.endswith(NOFILL)
    name, at, size = method.removesuffix(SERIAL).removesuffix(NOFILL).partition("@")
    return name, int(size) if at else None, overlap, fill


class EdgeClient:
    """One edge client: its connection, drafter and tree-size controller, kept from one job to the next (a
    drafter learns across prompts), and its name, under which the verifier keeps its drafting state for it
    (cloud/verifier_drafter.py: one client's jobs must not teach another's). `metered`: each job's verifier
    time and passes are read from the verifier's metrics (where it has them), which only works while no
    other client runs."""

    def __init__(self, verifier, method: str, drafter, max_tree: int, max_new_tokens: int, eos: list[int],
                 metered: bool, client_id: str = "") -> None:
        from specedge.edge.controller import TreeSizeController

        self.verifier, self.method, self.drafter, self.eos, self.metered = verifier, method, drafter, eos, metered
        self.client_id = client_id
        self.client = connect(verifier)
        _, fixed, overlap, fill = split_method(method)
        self.controller = TreeSizeController(max_tree, fixed=fixed, overlap=overlap, fill=fill)
        self.params = SamplingParams(max_new_tokens=max_new_tokens)

    def run(self, i: int, ids: list[int]) -> JobResult:
        from specedge.edge.drafter import hints_wanted
        from specedge.edge.generation import generate

        before, start = self._engine_time(), time.perf_counter()
        if self.method == "server-ar":
            tokens = [t for chunk in self.client.server_generate(ids, self.params) for t in chunk]
            r = JobResult(i, tokens, None, [], [])
        else:
            hints = min(hints_wanted(self.drafter), self.client.info.limits.max_hints_top_k)
            session = self.client.open(ids, self.params, self.client_id, hints_top_k=hints)
            g = generate(session, self.eos, self.drafter, self.controller if self.drafter is not None else None)
            r = JobResult(i, g.token_ids, g.rounds, g.draft_ms, g.tree_sizes, g.accepted, g.compute_ms, g.queue_ms,
                          g.network_ms, g.sent_ms, g.verdict_ms, g.ahead, g.verifier_drafted)
        r.wall_s = time.perf_counter() - start
        if before is not None and (after := self._engine_time()) is not None:
            r.verifier_s, r.passes = after[0] - before[0], int(after[1] - before[1])
        return r

    def _engine_time(self) -> tuple[float, float] | None:
        if not self.metered:
            return None
        seconds = self.verifier.metric("specedge_step_seconds_sum")
        steps = self.verifier.metric("specedge_step_seconds_count")
        return None if seconds is None else (seconds, steps)

    def close(self) -> None:
        self.client.close()


def run_level(verifier, method: str, jobs: list[list[int]], concurrency: int, max_new_tokens: int, eos: list[int],
              make_drafter, max_tree: int) -> tuple[list[JobResult], float]:
    """All jobs through `concurrency` client threads -> (results, wall seconds); client k drafts with
    `make_drafter(k)`. `server-ar`: the verifier decodes (one request per job); `remote-ar`: the edge asks
    for one token per round trip (no drafts)."""
    results: list[JobResult] = []
    lock = threading.Lock()
    next_job = iter(range(len(jobs)))
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        drafter = make_drafter(k) if method not in WITHOUT_DRAFTS else None
        client = EdgeClient(verifier, method, drafter, max_tree, max_new_tokens, eos, metered=concurrency == 1,
                            client_id=f"{method}#{k}")
        try:
            while True:
                with lock:
                    i = next(next_job, None)
                if i is None:
                    return
                r = client.run(i, jobs[i])
                with lock:
                    results.append(r)
        except BaseException as e:  # reported by the caller
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: r.prompt), wall


def run_interleaved(verifier, methods: list[str], jobs: list[list[int]], max_new_tokens: int, eos: list[int],
                    make_drafter, max_tree: int, reverse: bool = False,
                    on_job: Callable[[int, dict[str, JobResult]], None] | None = None) -> dict[str, list[JobResult]]:
    """One client per method against one verifier, job by job: every method generates job 0, then job 1, ...
    (in `methods`' order on even jobs, reversed on odd ones; `reverse` swaps that), the verifier's prefix
    cache flushed before each generation. So the methods share the verifier process's speed (it varies from
    one process to the next: BENCHMARKS.md section 6) and the host's drift, job by job.
    `on_job(job, {method: its result})` after each job (progress)."""
    clients = {m: EdgeClient(verifier, m, make_drafter(m) if m not in WITHOUT_DRAFTS else None,
                             max_tree, max_new_tokens, eos, metered=True, client_id=m) for m in methods}
    flusher = connect(verifier)
    results: dict[str, list[JobResult]] = {m: [] for m in methods}
    try:
        for i, ids in enumerate(jobs):
            for method in methods if (i % 2 == 1) == reverse else methods[::-1]:
                _wait_until_idle()
                flusher.flush_cache()
                results[method].append(clients[method].run(i, ids))
            if on_job is not None:
                on_job(i, {m: results[m][-1] for m in methods})
    finally:
        flusher.close()
        for client in clients.values():
            client.close()
    return results


IDLE_CPU_SHARE = 0.1  # of one core, over IDLE_WINDOW_S: this process has nothing left running
IDLE_WINDOW_S = 0.02


def _wait_until_idle(limit_s: float = 2.0) -> None:
    """Until this process's threads stop using CPU (a drafter's background work for the last generation,
    such as a model reading the rest of its prompt, must not run into the next method's time), at most
    `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        used = time.process_time()
        time.sleep(IDLE_WINDOW_S)
        if time.process_time() - used < IDLE_CPU_SHARE * IDLE_WINDOW_S:
            return


@dataclass
class RunningVerifier:
    """A verifier (or router) started elsewhere: `--server`, reached with the bench's --auth-token and TLS
    flags (`channel`)."""

    target: str
    channel: object = None  # edge.transport.ChannelConfig

    def metric(self, name: str) -> float | None:
        return None


def serving_rows(args, prompts, encoded, eos: list[int], check, tokenizer=None,
                 local=None) -> tuple[list[dict], dict[str, str]]:
    """Rows for every (method, concurrency, rtt) level, and with one client per category too;
    `check(method, prompt, ids, want, got)` raises on a greedy mismatch. `local(method, ids)` -> (tokens,
    wall s) runs the in-process baselines (transformers'), once per repetition, with one client only; one that
    raises PeerFailed is left out, and the second return value says why (method -> reason).
    Every generation also goes to --out's runs.jsonl (e.g. as references for bench/replay.py)."""
    from specedge.bench.hf_baselines import HF_BASELINES, PeerFailed
    from specedge.edge.registry import make_drafter

    levels = [int(c) for c in str(args.concurrency).split(",")]
    rtts = [float(r) for r in str(args.rtt_ms).split(",")]
    drafters = [d + ("" if size is None else f"@{size}") + ("" if overlap else SERIAL) + ("" if fill else NOFILL)
                for d in args.drafters.split(",") if d for size in tree_policies(args.tree_size)
                for overlap in on_off("--overlap", args.overlap) for fill in on_off("--fill", args.fill)
                if overlap or fill]  # (a serial drafter sends nothing ahead to fill)
    remote = ["remote-ar"] if "remote-ar" in args.baselines.split(",") else []
    in_process = [b for b in args.baselines.split(",") if b in HF_BASELINES]
    methods = ["server-ar", *remote, *drafters]
    rows = []
    serve_args = ["--model", args.model, "--kv-pool-mb", str(args.kv_pool_mb), "--max-batch-tokens",
                  str(args.max_batch_tokens), "--max-tree-tokens", str(max(args.max_tree, 1)),
                  "--max-sessions-per-client", "1024", "--grace-s", "0"]
    if args.pin_cores:
        serve_args += ["--threads", "1"]
    runs: list[dict] = []
    failures: dict[str, str] = {}

    def record(method: str, rep: int, concurrency: int, rtt: float | None, results: list[JobResult]) -> None:
        for r in results:
            prompt = prompts[r.prompt % len(prompts)]
            runs.append({**dataclasses.asdict(r), "method": method, "category": prompt.category, "prompt": prompt.id,
                         "rep": rep, "concurrency": concurrency, "rtt_ms": rtt})

    def new_drafter(method: str, client: int):
        """`mix:A+B+...`: client k drafts with the k-th drafter of the list, round robin."""
        method = split_method(method)[0]
        if method.startswith("mix:"):
            mixed = method.removeprefix("mix:").split("+")
            method = mixed[client % len(mixed)]
        return make_drafter(method, None, max_nodes=args.max_tree, tokenizer=tokenizer, eos_ids=eos)

    for concurrency in levels:
        jobs = [encoded[i % len(encoded)] for i in range(max(len(encoded), concurrency))]
        for level, rtt in enumerate(rtts):
            per_method: dict[str, list[tuple[float, float, list[JobResult]]]] = {m: [] for m in methods}
            local_methods = list(in_process) if concurrency == 1 and level == 0 and local is not None else []
            per_method.update({m: [] for m in local_methods})
            for rep in range(args.reps):
                # Odd repetitions run the methods in reverse order: a host whose speed drifts during the
                # run favours none of them.
                if concurrency == 1 and not args.server:  # one verifier for all methods, prompt by prompt
                    with _warm_verifier(args, serve_args, emulated_link(args, rtt), jobs) as verifier:
                        interleaved = run_interleaved(verifier, methods, jobs, args.max_new_tokens, eos,
                                                      lambda m: new_drafter(m, 0), args.max_tree, reverse=rep % 2 == 1,
                                                      on_job=_job_printer(f"rtt {rtt:g} ms rep {rep + 1}", prompts,
                                                                          len(jobs)))
                        peak = verifier.metric("specedge_kv_peak_bytes")
                    levels_run = [(m, interleaved[m], sum(r.wall_s for r in interleaved[m]), peak) for m in methods]
                else:
                    levels_run = []
                    for method in methods if rep % 2 == 0 else methods[::-1]:
                        with _warm_verifier(args, serve_args, emulated_link(args, rtt), jobs) as verifier:
                            results, wall = run_level(verifier, method, jobs, concurrency, args.max_new_tokens, eos,
                                                      lambda k, m=method: new_drafter(m, k), args.max_tree)
                            levels_run.append((method, results, wall, verifier.metric("specedge_kv_peak_bytes")))
                for method, results, wall, peak in levels_run:
                    per_method[method].append((sum(len(r.tokens) for r in results) / wall, peak, results))
                    record(method, rep, concurrency, rtt, results)
                    kv = "" if peak is None else f", KV peak {peak / 2**20:.1f} MiB"
                    print(f"[serving] concurrency {concurrency} rtt {rtt:g} ms rep {rep + 1} {method}: "
                          f"{per_method[method][-1][0]:.1f} tokens/s{kv}", flush=True)
                for method in list(local_methods):
                    results = []
                    try:
                        for i, ids in enumerate(jobs):
                            tokens, wall = local(method, ids)
                            results.append(JobResult(i, tokens, None, [], [], wall_s=wall))
                    except PeerFailed as e:
                        p = prompts[i % len(prompts)]
                        failures[method] = f"{e} (prompt {p.id}, {p.category})"
                        print(f"[in-process] rep {rep + 1} {method} left out: {failures[method]}", flush=True)
                        local_methods.remove(method)
                        del per_method[method]
                        runs[:] = [r for r in runs if r["method"] != method]
                        continue
                    tps = sum(len(r.tokens) for r in results) / sum(r.wall_s for r in results)
                    per_method[method].append((tps, None, results))
                    record(method, rep, concurrency, None, results)
                    print(f"[in-process] rep {rep + 1} {method}: {tps:.1f} tokens/s", flush=True)
            reference = {r.prompt: r.tokens for r in per_method["server-ar"][0][2]}
            for method in [*remote, *drafters, *local_methods]:
                for _, _, results in per_method[method]:
                    for r in results:
                        if r.tokens != reference[r.prompt]:
                            p = prompts[r.prompt % len(prompts)]
                            check(method, p, jobs[r.prompt], reference[r.prompt], r.tokens)
            categories = [prompts[i % len(prompts)].category for i in range(len(jobs))]
            groups = [*dict.fromkeys(categories), "all"] if concurrency == 1 else ["all"]
            for group in groups:
                wanted = {i for i, c in enumerate(categories) if group in ("all", c)}
                for method in [*methods, *local_methods]:
                    base = "hf-ar" if method in local_methods and "hf-ar" in local_methods else "server-ar"
                    rows.append(_row(method, group, wanted, per_method[method], per_method[base], concurrency,
                                     rtt if method not in local_methods else None, args.reps, base))
    with open(args.out / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in runs)
    return rows, failures


def _job_printer(label: str, prompts, jobs: int) -> Callable[[int, dict[str, JobResult]], None]:
    """Progress of an interleaved level: one line per job, every method's tokens/s on it."""

    def on_job(i: int, done: dict[str, JobResult]) -> None:
        rates = ", ".join(f"{m} {len(r.tokens) / r.wall_s:.1f}" for m, r in done.items())
        print(f"[serving] {label} prompt {i + 1}/{jobs} ({prompts[i % len(prompts)].category}): {rates} tokens/s",
              flush=True)

    return on_job


def _row(method: str, category: str, wanted: set[int], runs, base_runs, concurrency: int, rtt: float | None,
         reps: int, base: str) -> dict:
    """One row: medians over repetitions of tokens/s (of the level's wall time for all jobs at once, of the
    jobs' own times for one category), speedup over `base` in the same repetition."""

    def tps(level_tps: float, results: list[JobResult]) -> float:
        if category == "all" and concurrency > 1:
            return level_tps
        mine = [r for r in results if r.prompt in wanted]
        return sum(len(r.tokens) for r in mine) / sum(r.wall_s for r in mine)

    rates = [tps(t, results) for t, _, results in runs]
    base_rates = [tps(t, results) for t, _, results in base_runs]
    every = [r for _, _, results in runs for r in results if r.prompt in wanted]
    tokens = sum(len(r.tokens) for r in every)
    rounds = [r.rounds for r in every if r.rounds]
    drafts = [ms for r in every for ms in r.draft_ms]
    sizes = [s for r in every for s in r.tree_sizes]
    metered = [r for r in every if r.verifier_s is not None]
    name, fixed, overlap, fill = split_method(method)

    def per_round(part: str) -> float | None:
        values = [ms for r in every for ms in getattr(r, part)]
        return round(statistics.mean(values), 2) if values else None

    metered_tokens = sum(len(r.tokens) for r in metered)
    return {
        "method": method, "category": category, "n_prompts": len(wanted), "concurrency": concurrency,
        "rtt_ms": rtt, "tokens_per_s": round(statistics.median(rates), 3),
        "speedup": round(statistics.median(t / b for t, b in zip(rates, base_rates)), 3),
        "mean_accepted": round(tokens / sum(rounds), 3) if rounds else None,
        "passes_per_token": round(sum(r.passes for r in metered) / metered_tokens, 3) if metered_tokens else None,
        "verifier_ms_per_token": round(1e3 * sum(r.verifier_s for r in metered) / metered_tokens, 2)
        if metered_tokens else None,
        "draft_ms": round(statistics.median(drafts), 3) if drafts else None,
        "tree_size": round(statistics.mean(sizes), 2) if sizes else None,
        "tree_policy": None if name in WITHOUT_DRAFTS or rtt is None else fixed or "adaptive",
        "overlap": None if name in WITHOUT_DRAFTS or rtt is None else overlap,
        "ahead_rounds": sum(r.ahead for r in every) if rounds else None,
        "fill": None if name in WITHOUT_DRAFTS or rtt is None or not overlap else fill,
        "verifier_drafted": round(sum(r.verifier_drafted for r in every) / tokens, 3) if rounds else None,
        # The mean round, split: drafting on the edge, then network, the verifier's queue and its pass.
        "round_draft_ms": per_round("draft_ms"), "round_network_ms": per_round("network_ms"),
        "round_queue_ms": per_round("queue_ms"), "round_compute_ms": per_round("compute_ms"),
        "kv_peak_bytes": None if runs[0][1] is None else int(max(peak for _, peak, _ in runs)),
        "baseline": base, "reps": reps,
    }


def tree_policies(spec: str) -> list[int | None]:
    """--tree-size "adaptive,8,32" -> [None, 8, 32] (None: the controller's expected-value choice)."""
    policies = []
    for part in str(spec).split(","):
        if part.strip() == "adaptive":
            policies.append(None)
        elif part.strip().isdigit() and int(part) > 0:
            policies.append(int(part))
        else:
            raise ValueError(f"--tree-size takes `adaptive` and sizes >= 1, comma-separated; got {part!r}")
    return policies


def on_off(flag: str, spec: str) -> list[bool]:
    """--overlap "on,off" -> [True, False]."""
    policies = [{"on": True, "off": False}.get(part.strip()) for part in str(spec).split(",")]
    if None in policies:
        raise ValueError(f"{flag} takes on, off or on,off; got {spec!r}")
    return policies


def emulated_link(args, rtt_ms: float):
    """The network-emulating proxy's conditions for one round-trip level: half the round trip each way, the
    jitter at most that half (a delay cannot go negative), the bandwidth; None: no proxy (0 ms, nothing else
    asked)."""
    if not (rtt_ms or args.jitter_ms or args.bandwidth_kbps):
        return None
    from specedge.netem.proxy import NetworkConditions

    return NetworkConditions(delay_ms=rtt_ms / 2, jitter_ms=min(args.jitter_ms, rtt_ms / 2),
                             bandwidth_mbps=args.bandwidth_kbps / 1e3, seed=0)


@contextlib.contextmanager
def _warm_verifier(args, serve_args: list[str], link, jobs: list[list[int]]):
    """_verifier, after one short untimed generation (the first step's allocations)."""
    with _verifier(args, serve_args, link) as verifier:
        warm = connect(verifier)
        list(warm.server_generate(jobs[0][:32], SamplingParams(max_new_tokens=8)))
        warm.close()
        yield verifier


@contextlib.contextmanager
def _verifier(args, serve_args: list[str], link=None):
    """The verifier to measure against; behind the network-emulating proxy (`--netem`, or the level's
    `link`) when asked."""
    if args.server:
        from specedge.cli.flags import channel_config

        verifier = contextlib.nullcontext(RunningVerifier(args.server, channel_config(args)))
    else:
        from specedge.cloud.launch import VerifierProcess

        verifier = VerifierProcess(*serve_args, cpus=pinned_cores(args.pin_cores)[1] if args.pin_cores else None)
    with verifier as v:
        if not args.netem and link is None:
            yield v
            return
        from specedge.netem.proxy import EmbeddedProxy, parse_conditions

        with EmbeddedProxy(v.target, link or parse_conditions(args.netem)) as proxy:
            yield _Behind(v, proxy.target)


@dataclass
class _Behind:
    """A verifier reached through a proxy: the proxy's address, the verifier's metrics."""

    verifier: object
    target: str

    def metric(self, name: str):
        return self.verifier.metric(name)

    @property
    def channel(self):
        return getattr(self.verifier, "channel", None)


def connect(verifier):
    """A client's connection to the verifier measured (a RemoteVerifier), with the --server flags where given."""
    from specedge.edge.transport import RemoteVerifier

    return RemoteVerifier(verifier.target, getattr(verifier, "channel", None))




def pinned_cores(spec: str) -> tuple[set[int], set[int]]:
    """--pin-cores EDGE,VERIFIER -> ({edge core}, {verifier core})."""
    edge, _, verifier = spec.partition(",")
    return {int(edge)}, {int(verifier)}
