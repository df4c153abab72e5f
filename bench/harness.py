"""`specedge bench`: methods side by side on the same prompts in one run, interleaved, medians of reps.

Every method generates for every prompt in every repetition, in the same order, so the machine's noise
hits all of them alike. Greedy outputs of every method are checked against `ar` of the same repetition.
With concurrency, round trips or the `server-ar` baseline, it measures edge clients against a verifier
over gRPC instead (bench/serving.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

import grpc

from specedge.bench.hf_baselines import HF_BASELINES, HFBaselines, PeerFailed
from specedge.bench.report import plot_serving, plot_speedup, progress_reporter, write_results
from specedge.bench.specbench import Prompt
from specedge.bench.workloads import load_prompts

BASELINES = ("ar", "hf-ar", "hf-pld", "hf-assisted", "hf-uag", "suffix", "oracle", "server-ar", "remote-ar")


@dataclass
class Run:
    method: str
    category: str
    prompt: str
    rep: int
    tokens: list[int]
    wall_s: float
    ttft_s: float | None  # the first pass, which prefills the prompt (None: not measurable, hf-*)
    rounds: int | None
    draft_ms: list[float]
    tree_sizes: list[int]


class Methods:
    """How each method generates one prompt; all share one model and one engine."""

    def __init__(self, args, hf, hf_tokenizer, engine, store) -> None:
        from specedge.cloud.local import LocalVerifier
        from specedge.cloud.model_registry import eos_token_ids
        from specedge.edge.tokenizer import EdgeTokenizer

        self.args, self.engine = args, engine
        self.tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
        self.hf_baselines = HFBaselines(hf, hf_tokenizer, args.model, args.drafting_model)
        self.verifier = LocalVerifier(engine)
        self.eos = eos_token_ids(hf)
        self.store = store
        self.new_repetition()

    def new_repetition(self) -> None:
        """Fresh drafters: nothing one repetition learned (SuffixDecoding's cache of earlier responses,
        the retrieval drafter's acceptance statistics) may carry the answers into the next one."""
        from specedge.edge.controller import TreeSizeController
        from specedge.edge.registry import make_drafter

        args = self.args
        self.controller = TreeSizeController(args.max_tree)
        self.drafters = {}
        for name in [d for d in args.drafters.split(",") if d]:
            self.drafters[name] = make_drafter(name, None, max_nodes=args.max_tree, tokenizer=self.tokenizer,
                                               eos_ids=self.eos)
            if self.store is not None and not name.startswith("model:"):  # with and without it, side by side
                self.drafters[f"{name}+corpus"] = make_drafter(name, self.store, max_nodes=args.max_tree,
                                                               tokenizer=self.tokenizer, eos_ids=self.eos)
        self.suffix = None
        if "suffix" in args.baselines.split(","):
            from specedge.bench.suffix_drafter import SuffixDecodingDrafter

            self.suffix = SuffixDecodingDrafter(max_spec_tokens=min(args.max_tree, 16))

    def names(self) -> list[str]:
        baselines = [b for b in self.args.baselines.split(",") if b and b != "ar"]
        unknown = set(baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {', '.join(BASELINES)}")
        return ["ar", *self.drafters, *baselines]

    def run(self, method: str, ids: list[int], reference: list[int] | None):
        """-> (tokens, wall_s, ttft_s or None, rounds or None, draft_ms, tree_sizes)."""
        from specedge.bench.oracle import OracleDrafter
        from specedge.common.params import SamplingParams
        from specedge.edge.drafter import hints_wanted
        from specedge.edge.generation import generate

        params = SamplingParams(max_new_tokens=self.args.max_new_tokens)
        self.engine.pool.drop_cached()  # no method may reuse another's prefill
        if method.startswith("hf-"):
            return self._hf(method, ids)
        drafter, controller = None, None
        if method in self.drafters:
            drafter, controller = self.drafters[method], self.controller
        elif method == "suffix":
            drafter = self.suffix
        elif method == "oracle":
            drafter = OracleDrafter(ids + reference, self.args.oracle_depth)
        r = generate(self.verifier.open(ids, params, hints_wanted(drafter)), self.eos, drafter, controller)
        return r.token_ids, r.wall_s, r.ttft_s, r.rounds, r.draft_ms, r.tree_sizes

    def _hf(self, method: str, ids: list[int]):
        tokens, wall = self.hf_baselines.run(method, ids, self.args.max_new_tokens)
        return tokens, wall, None, None, [], []


def run_bench(args: argparse.Namespace) -> int:
    from specedge.cloud.engine import Engine
    from specedge.cloud.model_registry import eos_token_ids, load_model
    from specedge.edge.corpus import open_corpus
    from specedge.edge.tokenizer import EdgeTokenizer

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"specedge bench: {msg}")

    serving = (args.rtt_ms not in ("0", "0.0") or args.concurrency != "1" or bool(args.netem) or bool(args.pin_cores)
               or bool({"server-ar", "remote-ar"} & set(args.baselines.split(","))) or args.tree_size != "adaptive"
               or bool(args.jitter_ms or args.bandwidth_kbps) or args.overlap != "on"
               or args.fill != "on")
    try:  # bad network flags fail before anything starts
        _check_network_args(args)
    except ValueError as e:
        raise fail(str(e))
    if args.server:
        return _run_against_server(args)
    try:
        prompts = load_prompts(args)
        hf, hf_tokenizer = load_model(args.model)
        tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
        store = open_corpus(args.corpus, tokenizer) if args.corpus else None
        engine = Engine.from_hf_model(hf, kv_pool_bytes=args.kv_pool_mb << 20)
        if serving:
            _check_serving_args(args, store)
            local = _in_process_baselines(args, hf, hf_tokenizer)
        else:
            methods = Methods(args, hf, hf_tokenizer, engine, store)
            names = methods.names()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise fail(str(e))
    encoded = [tokenizer.encode_prompt(p.text, chat=args.chat) for p in prompts]
    args.out.mkdir(parents=True, exist_ok=True)
    if serving:
        from specedge.bench.serving import serving_rows

        def check(method, prompt, ids, want, got):
            check_greedy_match(engine, method, prompt, ids, want, got)

        rows, failures = serving_rows(args, prompts, encoded, eos_token_ids(hf), check, tokenizer, local)
        write_results(args, rows, store, failures)
        plot_serving(rows, args.out)
        return 0

    runs: list[Run] = []
    failures: dict[str, str] = {}  # method -> why it was left out
    total = args.reps * len(prompts) * len(names)
    progress = progress_reporter(total)
    # One untimed warm-up generation so the first timed method does not pay for allocations.
    methods.run("ar", encoded[0][:64], None)
    for rep in range(args.reps):
        methods.new_repetition()
        for p, ids in zip(prompts, encoded):
            reference = None
            for name in names:
                if name in failures:
                    continue
                try:
                    tokens, wall, ttft, rounds, draft_ms, sizes = methods.run(name, ids, reference)
                except PeerFailed as e:
                    failures[name] = f"{e} (prompt {p.id}, {p.category})"
                    progress(f"{name} left out: {failures[name]}")
                    continue
                if name == "ar":
                    reference = tokens
                elif tokens != reference:
                    check_greedy_match(engine, name, p, ids, reference, tokens)
                runs.append(Run(name, p.category, p.id, rep, tokens, wall, ttft, rounds, draft_ms, sizes))
                progress(f"rep {rep + 1}/{args.reps} {p.category}/{p.id} {name}: "
                         f"{len(tokens) / wall:.1f} tokens/s")
    progress(None)
    with open(args.out / "runs.jsonl", "w") as f:  # every generation, for analyses the table does not do
        f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in runs)
    runs = [r for r in runs if r.method not in failures]
    rows = summarize(runs, [n for n in names if n not in failures], args)
    write_results(args, rows, store, failures)
    plot_speedup(rows, args.out)
    return 0


def _run_against_server(args: argparse.Namespace) -> int:
    """gRPC mode against a running verifier or router: an edge-only run (no model here; the tokenizer comes
    from the verifier). Greedy mismatches are errors outright: near-ties cannot be checked without the model."""
    from specedge.bench.serving import serving_rows
    from specedge.cli.flags import channel_config
    from specedge.edge.tokenizer_cache import verifier_tokenizer
    from specedge.edge.transport import RemoteVerifier

    try:
        _check_serving_args(args, None)
        prompts = load_prompts(args)
        verifier = RemoteVerifier(args.server, channel_config(args))
        tokenizer = verifier_tokenizer(verifier)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"specedge bench: {e}")
    except grpc.RpcError as e:
        raise SystemExit(f"specedge bench: cannot use --server {args.server}: {e.code().name}: {e.details()}")
    eos = list(verifier.info.eos_token_ids)
    verifier.close()
    encoded = [tokenizer.encode_prompt(p.text, chat=args.chat) for p in prompts]
    args.out.mkdir(parents=True, exist_ok=True)

    def check(method, prompt, ids, want, got):
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise SystemExit(f"specedge bench: {method} output differs from server-ar on {prompt.category}/{prompt.id} "
                         f"at token {at}: speculative decoding must be lossless")

    rows, failures = serving_rows(args, prompts, encoded, eos, check, tokenizer)
    write_results(args, rows, None, failures)
    plot_serving(rows, args.out)
    return 0


def _check_network_args(args) -> None:
    from specedge.bench.serving import on_off, tree_policies
    from specedge.netem.proxy import parse_conditions

    if args.netem:
        parse_conditions(args.netem)
    tree_policies(args.tree_size)
    on_off("--overlap", args.overlap)
    on_off("--fill", args.fill)
    if args.jitter_ms < 0 or args.bandwidth_kbps < 0:
        raise ValueError("--jitter-ms and --bandwidth-kbps must be >= 0")
    if (args.jitter_ms or args.bandwidth_kbps or args.rtt_ms not in ("0", "0.0")) and args.netem:
        raise ValueError("give either --netem or --rtt-ms/--jitter-ms/--bandwidth-kbps, not both")


def _check_serving_args(args, store) -> None:
    in_process = set() if args.server else set(HF_BASELINES)
    unknown = set(b for b in args.baselines.split(",") if b) - {"ar", "server-ar", "remote-ar"} - in_process
    if unknown:
        raise ValueError(f"in gRPC mode (--concurrency/--rtt-ms/--pin-cores/--tree-size/server-ar/remote-ar) the "
                         f"baselines are server-ar, remote-ar{' and hf-*' if in_process else ''}; {sorted(unknown)} "
                         "run in-process only")

    if in_process & set(args.baselines.split(",")) and "1" not in str(args.concurrency).split(","):
        raise ValueError("transformers' baselines run one generation at a time: include 1 in --concurrency")
    if store is not None:
        raise ValueError("--corpus is not supported in gRPC mode yet")
    if args.pin_cores:
        cores = args.pin_cores.split(",")
        if len(cores) != 2 or not all(c.isdigit() for c in cores) or cores[0] == cores[1] or \
                not {int(c) for c in cores} <= os.sched_getaffinity(0):
            raise ValueError(f"--pin-cores takes two different cores of this machine as EDGE,VERIFIER "
                             f"(available: {sorted(os.sched_getaffinity(0))}); got {args.pin_cores!r}")
        if args.server:
            raise ValueError("--pin-cores starts its own verifier: leave out --server")


def _in_process_baselines(args, hf, hf_tokenizer):
    """(method, ids) -> (tokens, wall s) for transformers' baselines; with --pin-cores this process moves to
    the edge core now, and to both cores (two threads) while a baseline runs."""
    import torch

    baselines = HFBaselines(hf, hf_tokenizer, args.model, args.drafting_model)
    if not args.pin_cores:
        return lambda method, ids: baselines.run(method, ids, args.max_new_tokens)
    from specedge.bench.serving import pinned_cores

    edge, verifier = pinned_cores(args.pin_cores)
    os.sched_setaffinity(0, edge)
    torch.set_num_threads(1)

    def run(method: str, ids: list[int]):
        os.sched_setaffinity(0, edge | verifier)
        torch.set_num_threads(2)
        try:
            return baselines.run(method, ids, args.max_new_tokens)
        finally:
            os.sched_setaffinity(0, edge)
            torch.set_num_threads(1)

    return run


def summarize(runs: list[Run], names: list[str], args) -> list[dict]:
    """One row per (method, category) plus an `all` category: medians over repetitions."""
    by = defaultdict(list)
    for r in runs:
        by[(r.method, r.category, r.rep)].append(r)
        by[(r.method, "all", r.rep)].append(r)
    categories = list(dict.fromkeys(r.category for r in runs)) + ["all"]
    rows = []
    for cat in categories:
        ar_tps = {rep: _tps(by[("ar", cat, rep)]) for rep in range(args.reps)}
        ar_decode = {rep: _decode_tps(by[("ar", cat, rep)]) for rep in range(args.reps)}
        for name in names:
            reps = [by[(name, cat, rep)] for rep in range(args.reps)]
            tps = [_tps(rs) for rs in reps]
            decode = [_decode_tps(rs) for rs in reps]
            every = [r for rs in reps for r in rs]
            rounds = [r.rounds for r in every if r.rounds is not None]
            drafts = [ms for r in every for ms in r.draft_ms]
            sizes = [s for r in every for s in r.tree_sizes]
            rows.append({
                "method": name, "category": cat, "n_prompts": len(reps[0]),
                "tokens_per_s": round(statistics.median(tps), 3),
                "speedup": round(statistics.median(t / ar_tps[rep] for rep, t in enumerate(tps)), 3),
                "mean_accepted": round(sum(len(r.tokens) for r in every if r.rounds) / sum(rounds), 3)
                if rounds else None,
                "draft_ms": round(statistics.median(drafts), 3) if drafts else None,
                "decode_tokens_per_s": round(statistics.median(decode), 3) if decode[0] else None,
                "decode_speedup": round(statistics.median(d / ar_decode[rep] for rep, d in enumerate(decode)), 3)
                if decode[0] else None,
                "ttft_ms": round(statistics.median(1e3 * r.ttft_s for r in every), 1) if decode[0] else None,
                "rtt_ms": 0.0, "concurrency": 1,
                "tree_size": round(statistics.mean(sizes), 2) if sizes else None,
                "tokens": sum(len(r.tokens) for r in every), "reps": args.reps,
            })
    return rows


def _tps(runs: list[Run]) -> float:
    return sum(len(r.tokens) for r in runs) / sum(r.wall_s for r in runs)


def _decode_tps(runs: list[Run]) -> float:
    """Tokens after the first over the time after the first pass (0 when the first pass is not known)."""
    if any(r.ttft_s is None for r in runs):
        return 0.0
    return sum(len(r.tokens) - 1 for r in runs) / sum(r.wall_s - r.ttft_s for r in runs)


def check_greedy_match(engine, method: str, prompt: Prompt, ids: list[int], want: list[int], got: list[int]) -> None:
    """A greedy mismatch is an error unless the target's top-2 logits at the first difference are a near-tie
    (gap below 1e-3, the engine's measured parity tolerance), in which case both outputs are valid greedy."""
    from specedge.common.draft_tree import DraftTree
    from specedge.common.params import SamplingParams

    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    if at < min(len(want), len(got)):
        seq = engine.add_sequence(ids + want[:at], SamplingParams())
        try:
            (logits,) = engine.forward([(seq, DraftTree.empty())])
        finally:
            engine.release(seq)
        top = logits[0].topk(2).values
        gap = float(top[0] - top[1])
        if gap < 1e-3:
            print(f"note: {method} differs from ar on {prompt.category}/{prompt.id} at token {at}, a near-tie "
                  f"(top-2 gap {gap:.1e})", file=sys.stderr)
            return
        detail = f"top-2 logit gap {gap:.3f}"
    else:
        detail = f"lengths {len(want)} vs {len(got)}"
    raise SystemExit(f"specedge bench: {method} output differs from ar on {prompt.category}/{prompt.id} at token "
                     f"{at} ({detail}): speculative decoding must be lossless")
