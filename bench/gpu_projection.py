"""Projected speedups with a GPU verifier (issue 13): pass costs measured on the GPU (bench/gpu_bench.py's
JSON) combined with acceptance from a recorded CPU run (a `specedge bench` runs.jsonl with `ar` outputs),
replayed as bench/replay.py does: a greedy verifier accepts exactly the draft path that spells the recorded
output, so the drafter's trees and the tokens each pass commits need no model.

    .venv/bin/python bench/gpu_projection.py docs/benchmarks/gpu/h200.json bench-out/gpu-refs-smollm2/runs.jsonl \\
        --model smollm2-135m --chat

One client: each pass costs the GPU's measured time for its tokens with one session (at the measured
context nearest the session's), plus the edge's time for that round (measured here, by the clock, on this
machine's CPU: the draft, and the drafter's and the tree-size controller's `observe` of the verdict before
it; before 2026-11-27 only the draft was counted; since 2026-11-28 not what the drafter learns from a verdict
while the next is on its way); plain decoding costs one one-token pass per token at the
same context. The drafter sizes its trees from the GPU's cost curve, as it would from a GPU verifier's
advertised cost model. `--round-ms` adds a served round's way to the verifier and back besides the
pass (gRPC, the verifier's thread hand-offs; bench/round_split.py measures it) to every round, and
`--host-ms` bounds sixteen clients' steps, and server-side decoding's, by the verifier host's CPU time for
their rounds (one interpreter handles them all); by default both are left out.

Sixteen clients: a step of 16 sessions with t + 1 tokens each costs what the GPU measured for it; each
session commits A(t) tokens per step (the same replay with trees capped at t nodes); a client's round is
that step plus its edge time. Throughput 16 A(t) / (step + edge time) against server-side decoding,
16 tokens per step of 16 one-token sessions. The best t is reported with every t beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from specedge.bench.gpu_costs import nearest_context, single_session_costs
from specedge.bench.model_hints import ModelHints
from specedge.bench.replay import Recorded, ReplaySession, recorded_hints
from specedge.common.cost_model import CostModel
from specedge.common.hints import DEFAULT_HINTS_TOP_K
from specedge.edge.controller import TreeSizeController
from specedge.edge.drafter import hints_wanted
from specedge.edge.generation import generate
from specedge.edge.registry import make_drafter

CLIENTS = 16


def replay(recorded: Recorded, drafter_name: str, max_tree: int, cost_of, hints: dict | None,
           round_ms: float = 0.0, model_hints: ModelHints | None = None) -> list[dict]:
    """Per prompt: tokens after the first pass, passes, tree nodes, the edge's ms and pass ms (cost_of(context)
    prices each pass); `hints`: the target's recorded top k per output position (None: no hints); `model_hints`:
    every verified node's hints from the target instead; `round_ms`: what each round costs besides pass and
    edge, as the verdicts report it to the tree-size controller."""
    drafter = make_drafter(drafter_name, max_nodes=max_tree, tokenizer=recorded.tokenizer, eos_ids=recorded.eos_ids)
    controller = TreeSizeController(max_tree)
    out = []
    for p in recorded.prompts:
        ids = recorded.prompt_ids[p.id]
        cost = cost_of(len(ids))
        wants = hints_wanted(drafter) > 0
        session = ReplaySession(ids, recorded.refs[p.id], len(recorded.hf_tokenizer), cost, rtt_ms=round_ms,
                                hints=hints.get(p.id) if hints is not None and wants else None,
                                model_hints=model_hints if wants else None)
        observe_ms: list[float] = []
        # A drafter's `learn` (RetrievalDrafter.learn) is left out: where the session sends without waiting, as a
        # remote verifier's does, the generation loop calls it while the verdict is on its way.
        with timed_observe(drafter, observe_ms, untimed=getattr(drafter, "learn", None)), \
                timed_observe(controller, observe_ms):
            r = generate(session, (), drafter, controller)
        assert r.token_ids == recorded.refs[p.id]
        first = observe_ms[:2]  # the first verdict's (after the prompt's pass), left out as its draft is
        out.append({"prompt": p.id, "category": p.category, "context": len(ids), "tokens": len(r.token_ids) - 1,
                    "passes": r.rounds - 1, "nodes": sum(r.tree_sizes[1:]),
                    "edge_ms": sum(r.draft_ms[1:]) + sum(observe_ms) - sum(first),
                    "pass_ms": sum(session.pass_ms[1:]), "round_ms": (r.rounds - 1) * round_ms})
    return out


@contextmanager
def timed_observe(thing, spent: list[float], untimed: Callable[[], None] | None = None) -> Iterator[None]:
    """Within it, `thing.observe` adds its time (ms) per call to `spent`: the edge reads each verdict before
    it drafts the next tree, so that time is as much the round's as the draft's. `untimed` runs first, off the
    clock."""
    observe = thing.observe

    def timed(*args, **kwargs):
        if untimed is not None:
            untimed()
        start = time.perf_counter()
        try:
            return observe(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - start) * 1e3)

    thing.observe = timed
    try:
        yield
    finally:
        del thing.observe  # the class's method again


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gpu", type=Path, help="bench/gpu_bench.py's JSON")
    ap.add_argument("runs", type=Path, help="runs.jsonl of a `specedge bench` run that included `ar`")
    ap.add_argument("--model", default="smollm2-135m", help="the recorded run's target (its tokenizer)")
    ap.add_argument("--shapes", default=None, help="GPU shapes whose costs to use (default: the model's own)")
    ap.add_argument("--chat", action="store_true", help="the prompts in the model's chat template (as the run had)")
    ap.add_argument("--drafter", default="retrieval")
    ap.add_argument("--max-tree", type=int, default=64, help="most nodes per tree, one client")
    ap.add_argument("--hints", choices=("on-path", "model"), default=None,
                    help="verdicts carry the verifier's hints, and passes cost what the GPU measured with hints. "
                         "on-path: as far as the recorded output tells them (the root's and accepted nodes' rows); "
                         "model: the target computes every verified node's row on this CPU, as a verifier does "
                         "(one real forward per pass: minutes, kept for the next run: bench/model_hints.py)")
    ap.add_argument("--free-hints", action="store_true",
                    help="with --hints, passes cost what the GPU measured without hints: the bound for hints whose "
                         "top k cost the pass nothing (computed inside its graph), not a measurement")
    ap.add_argument("--round-ms", type=float, default=0.0,
                    help="add this to every round for its way to the verifier and back besides the pass (gRPC, the "
                         "scheduler's hand-offs: bench/round_split.py's `outside the step`); 0 leaves it out")
    ap.add_argument("--host-ms", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.0, 0.0),
                    metavar="ROUND,TOKEN", help="the verifier host's CPU time outside the step for a session's round "
                    "and for a token of server-side decoding (round_split.py --generate): with 16 clients a step "
                    "comes no oftener than 16 times it; 0,0 leaves it out")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    gpu = json.loads(args.gpu.read_text())
    shapes = {s["shape"]: s for s in gpu["shapes"]}
    recorded = Recorded.load(args.runs, args.model, args.chat)
    hints = recorded_hints(args.runs, args.model, recorded.prompt_ids, recorded.refs) \
        if args.hints == "on-path" else None
    model_hints = ModelHints.beside(args.runs, args.model) if args.hints == "model" else None
    # the passes' costs: as measured with hints, or (--free-hints) as without them
    hint_tokens = DEFAULT_HINTS_TOP_K if args.hints and not args.free_hints else 0
    results = {"gpu": gpu["info"], "runs": str(args.runs), "model": args.model, "drafter": args.drafter,
               "hints": DEFAULT_HINTS_TOP_K if args.hints else 0, "hints_from": args.hints,
               "hint_pass_costs": "none" if args.free_hints else "measured", "round_ms": args.round_ms,
               "host_ms": args.host_ms,
               "prompts": len(recorded.prompts), "shapes": {}}
    print(f"{len(recorded.prompts)} recorded prompts of {args.model}; GPU: {gpu['info']}")
    capped: dict[int, list[dict]] = {}  # tokens a session's pass -> replay with trees of that size
    for name in (args.shapes or args.model).split(","):
        shape = shapes[name]
        costs, plain = single_session_costs(shape, hint_tokens), single_session_costs(shape, 0)
        if not costs:
            raise SystemExit(f"{args.gpu} has no one-session costs of {name} with {hint_tokens} hint tokens")
        nearest, nearest_plain = nearest_context(costs), nearest_context(plain)
        rows = replay(recorded, args.drafter, args.max_tree, nearest, hints, args.round_ms, model_hints)
        for r in rows:  # plain decoding: a one-token pass per token, no hints
            r["plain_ms"] = r["tokens"] * nearest_plain(r["context"]).ms(0)
        single = {}
        for cat in sorted({r["category"] for r in rows}) + ["all"]:
            mine = [r for r in rows if cat in ("all", r["category"])]
            spec_ms = sum(r["pass_ms"] + r["edge_ms"] + r["round_ms"] for r in mine)
            single[cat] = {"speedup": sum(r["plain_ms"] for r in mine) / spec_ms,
                           "tokens_per_pass": sum(r["tokens"] for r in mine) / sum(r["passes"] for r in mine),
                           "nodes_per_pass": sum(r["nodes"] for r in mine) / sum(r["passes"] for r in mine),
                           "edge_ms_per_pass": sum(r["edge_ms"] for r in mine) / sum(r["passes"] for r in mine),
                           "pass_ms_per_pass": sum(r["pass_ms"] for r in mine) / sum(r["passes"] for r in mine)}
            s = single[cat]
            print(f"{name:<14} one client  {cat:<14} {s['speedup']:5.2f}x  tokens/pass {s['tokens_per_pass']:.2f}  "
                  f"nodes/pass {s['nodes_per_pass']:.1f}  pass {s['pass_ms_per_pass']:.2f} ms  "
                  f"edge {s['edge_ms_per_pass']:.2f} ms")
        steps = {r["tokens_each"]: r["ms"] for r in shape["by_sessions"]
                 if r["sessions"] == CLIENTS and r.get("hints", 0) == hint_tokens}
        plain_steps = {r["tokens_each"]: r["ms"] for r in shape["by_sessions"]
                       if r["sessions"] == CLIENTS and r.get("hints", 0) == 0}
        flat = CostModel(((0, 1.0), (1, 1.0)))  # trees always at their cap: the step price is the measured one
        # The verifier's host handles every session's round (a speculative round, or a token of server-side
        # decoding) on one interpreter: a step of CLIENTS sessions comes no oftener than CLIENTS times that.
        host_round_ms, host_token_ms = args.host_ms
        many = {"server_ar_tok_s": CLIENTS / max(plain_steps[1], CLIENTS * host_token_ms) * 1e3, "by_tree": {}}
        for tokens_each in sorted(t for t in steps if t > 1):
            if tokens_each not in capped:  # the same trees whatever the shape: every tree is at its cap
                capped[tokens_each] = replay(recorded, args.drafter, tokens_each - 1, lambda _: flat, hints,
                                             args.round_ms, model_hints)
            rows_t = capped[tokens_each]
            per_step = sum(r["tokens"] for r in rows_t) / sum(r["passes"] for r in rows_t)
            edge_ms = sum(r["edge_ms"] for r in rows_t) / sum(r["passes"] for r in rows_t)
            cycle_ms = max(steps[tokens_each] + edge_ms + args.round_ms, CLIENTS * host_round_ms)
            tok_s = CLIENTS * per_step / cycle_ms * 1e3
            many["by_tree"][tokens_each - 1] = {"tokens_per_step": per_step, "step_ms": steps[tokens_each],
                                                "edge_ms": edge_ms, "tok_s": tok_s,
                                                "vs_server_ar": tok_s / many["server_ar_tok_s"]}
        best = max(many["by_tree"], key=lambda t: many["by_tree"][t]["tok_s"])
        many["best_tree"], many["best_vs_server_ar"] = best, many["by_tree"][best]["vs_server_ar"]
        print(f"{name:<14} {CLIENTS} clients  server-side decoding {many['server_ar_tok_s']:.0f} tok/s; " + "; ".join(
            f"trees of {t}: {v['tokens_per_step']:.2f} tok/step, {v['step_ms']:.1f}+{v['edge_ms']:.1f} ms, "
            f"{v['vs_server_ar']:.2f}x" for t, v in many["by_tree"].items()))
        results["shapes"][name] = {"one_client": single, "clients_16": many,
                                   "median_edge_ms": statistics.median(r["edge_ms"] / max(1, r["passes"])
                                                                        for r in rows)}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
