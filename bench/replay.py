"""Replay recorded greedy generations against drafters, without the model: how many tokens each drafter
would commit per pass, and the decode speedup the verifier's cost model predicts for the trees it sends.

A greedy verifier accepts exactly the draft path that spells the model's own continuation, so a recorded
greedy output (the `ar` rows of a `specedge bench` run's runs.jsonl) answers every verification a drafter
could ask for. That makes drafter work a seconds-long loop instead of a half-hour benchmark; the real
benchmark (`specedge bench`) still decides, since it also pays real pass and drafting times.

With --hints the verdicts carry the verifier's hints (common/hints.py). `--hints on-path`: as far as a
recorded output can tell them: the target's top k at every position of the output, computed once per
prompt with the model (cached next to runs.jsonl), give the rows of the root and of every accepted node;
rejected and unreached nodes get no row (a real verifier computes theirs too, in contexts the output never
had), so the replay sees fewer hints than a real run. `--hints model`: the model computes every row, as a
verifier does (one real forward per pass: a few minutes for 12 prompts on a 2-core CPU), kept beside the runs
for the next replay that sends the same trees (bench/model_hints.py).
In both, the first verdict also carries the rows at the prompt's positions that a verifier sends an edge asking
for hints (cloud/prompt_hints.py), from the engine's prefill and cached beside the runs too; `--no-prompt-hints`
leaves them out.

With --timed each pass takes its modelled time (plus --rtt-ms) in real time, in a thread, as a remote
verifier's would: drafting models then pay their real drafting time and do their work during the pass
(prompt reading, speculation), and the speedup is measured by the clock. Pin it to one core
(`taskset -c 0`) to stand for a one-core edge. The timed session takes trees sent ahead of the verdict in
flight, as the served verifier does, so the edge pipelines its rounds over a round trip as in `specedge
bench` (PipelinedReplaySession); `--serial` waits for every verdict before the next tree instead (as the replays
in BENCHMARKS.md before its thirty-sixth session did).

    .venv/bin/python bench/replay.py bench-out/spec-main/runs.jsonl --chat
    .venv/bin/python bench/replay.py bench-out/spec-main/runs.jsonl --chat --hints model --cost flat
    taskset -c 0 .venv/bin/python bench/replay.py bench-out/model-drafting/runs.jsonl --model gemma3-270m \
        --drafters retrieval,model:smollm2-135m,hybrid --timed --base-ms 89 --rtt-ms 80

`--cost gpu:FILE:SHAPE` prices passes with what a GPU measured for a model's shape (bench/gpu_bench.py's JSON):
with --timed, the edge over a network with a GPU verifier, projected (the passes are sleeps of the GPU's
times; drafting is this machine's). With --timed and a round trip, `remote-ar` rows (a one-token pass and a
round trip per token) are written and printed beside the drafters, modelled, not replayed:

    taskset -c 0 .venv/bin/python bench/replay.py docs/benchmarks/gpu/refs-smollm2-135m.jsonl --chat --timed \
        --drafters retrieval:no-hints,retrieval:no-hints@8 --rtt-ms 80 \
        --cost gpu:docs/benchmarks/gpu/h200-run9a-compiled-smollm2-135m.json:smollm2-135m

`--cost cpu:FILE:MODEL` prices passes with MODEL's greedy steps as bench/engine_bench.py measured them on this
CPU (the real model, its int8 argmax included; the default prior is SmolLM2's curve scaled to --base-ms):

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/engine_bench.py --models gemma3-270m --parts cost \
        --tree-tokens 0,1,2,3,4,6,8,12,16,24,32,64 --reps 9 --out bench-out/engine-gemma
    taskset -c 0 .venv/bin/python bench/replay.py docs/benchmarks/model-drafting/refs-gemma3-270m-a.jsonl \
        --model gemma3-270m --drafters retrieval,hybrid --timed --cost cpu:bench-out/engine-gemma/results.json:gemma3-270m

With --out each generation is also written as a runs.jsonl row, so that bench/category_intervals.py gives
per-category intervals over the prompts (`--baseline ar`: plain decoding's modelled time); with --timed the
rows carry each round's times too, from which bench/verifier_idle.py tells where the verifier waited.

`--oracle COST` tells whether a drafter's tokens are lost to its choice of nodes or to its candidates: what a
perfect choice among the nodes each round drafted would commit, at n nodes and with the accepted path sent whole
(priced by COST); replay with free passes so that the rounds draft all they can:

    .venv/bin/python bench/replay.py bench-out/hints-main/runs.jsonl --chat --hints model --cost flat --max-tree 128 \
        --drafters retrieval --oracle cpu:bench-out/engine-smol/results.json:smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specedge.bench import specbench
from specedge.bench.gpu_costs import pass_costs
from specedge.bench.model_hints import ModelHints
from specedge.bench.perturbed import MARK, perturb
from specedge.cloud.acceptance import Verdict
from specedge.cloud.config import ServerConfig
from specedge.cloud.cost_tracker import PRIOR_RELATIVE
from specedge.cloud.verifier_drafter import VerifierDrafter, WarmDrafters, client_share
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import DEFAULT_HINTS_TOP_K, Hints
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.controller import MAX_IN_FLIGHT, TreeSizeController
from specedge.edge.drafter import hints_wanted
from specedge.edge.generation import generate
from specedge.edge.registry import make_drafter

BASE_MS = 55.0  # a plain decoding pass of SmolLM2-135M here (BENCHMARKS.md section 1)
PREFILL_MS_PER_TOKEN = 2.0  # the verifier's prompt prefill on one core (--timed only)


class ReplaySession:
    """A verifier session that answers from a recorded greedy output; passes cost what the prior says
    (and, `timed`, take that long, plus `rtt_ms`)."""

    def __init__(self, prompt_ids: list[int], output: list[int], vocab_size: int, cost: CostModel,
                 timed: bool = False, rtt_ms: float = 0.0, hints: Hints | None = None,
                 model_hints: ModelHints | None = None, prompt_hints: Hints | None = None) -> None:
        """`hints`: row j is the target's top tokens for output position j; `model_hints`: every node's row
        from the model instead (None and None: verdicts carry no hints); `prompt_hints`: what the first verdict
        carries at the prompt's positions (row j after prompt token j)."""
        self.prompt_ids, self.output, self.vocab_size, self.cost = list(prompt_ids), list(output), vocab_size, cost
        self.params = SamplingParams(max_new_tokens=len(output))
        self.hints, self.prompt_hints = hints, prompt_hints
        self.model_hints = model_hints.open(prompt_ids) if model_hints is not None else None
        self.max_tree_tokens = 1 << 30
        self.timed, self.rtt_ms = timed, rtt_ms
        self.done = 0
        self.pass_ms: list[float] = []

    def step(self, tree: DraftTree) -> StepResult:
        prefill_ms = self._prefill_ms()
        result = self._verify(tree)
        if self.timed:
            time.sleep((prefill_ms + result.compute_ms + self.rtt_ms) / 1e3)
        return result

    def _prefill_ms(self) -> float:
        """The verifier's prompt prefill, paid by the first pass."""
        return PREFILL_MS_PER_TOKEN * len(self.prompt_ids) if not self.pass_ms else 0.0

    def _verify(self, tree: DraftTree) -> StepResult:
        """The verdict on `tree`, rooted at the committed end, and the pass's modelled time (not waited)."""
        children = tree.children()
        accepted, node, tokens = [], -1, []
        while self.done + len(tokens) < len(self.output) - 1:
            want = self.output[self.done + len(tokens)]
            node = next((c for c in children[node + 1] if tree.tokens[c] == want), None)
            if node is None:
                break
            accepted.append(node)
            tokens.append(want)
        tokens.append(self.output[self.done + len(tokens)])  # the bonus token
        hints = None
        if self.model_hints is not None:  # every row, from the model
            hints = self.model_hints.rows(tree)
            self.model_hints.commit(tokens)
        elif self.hints is not None:  # the root's row and the accepted nodes' rows; the others are unknown here
            on_path = {node: self.done + 1 + a for a, node in enumerate(accepted)}
            rows = [self.done] + [on_path.get(i, -1) for i in range(len(tree))]
            hints = Hints([self.hints.ids[r] if r >= 0 else [] for r in rows],
                          [self.hints.probs[r] if r >= 0 else [] for r in rows])
        prompt_hints = self.prompt_hints if not self.pass_ms else None
        self.done += len(tokens)
        self.pass_ms.append(self.cost.ms(len(tree)))
        return StepResult(tokens=tokens, accepted=accepted, compute_ms=self.pass_ms[-1], rtt_ms=self.rtt_ms,
                          hints=hints, verified_nodes=len(tree), prompt_hints=prompt_hints)

    def cost_model(self) -> CostModel:
        return self.cost

    def close(self) -> None:
        if self.model_hints is not None:
            self.model_hints.close()
            self.model_hints = None


class PipelinedReplaySession(ReplaySession):
    """A timed replay session that also takes trees sent ahead of the verdict in flight, as the served
    verifier does (cloud/service.py), so that the edge pipelines its rounds over a round trip as it does in
    `specedge bench`: trees are verified in the order sent, each pass starting once its tree has arrived
    (half a round trip after it went out) and the pass before it has ended, its verdict back half a round
    trip after the pass. A tree ahead is verified less what the verdicts before it committed, and the verifier
    adds its own draft to what is left, up to `fill_tokens` nodes in all (cloud/verifier_drafter.py). Verdicts are
    worked out when their tree is sent (every tree before it is known then) and handed out at their time;
    the verifier's own drafting runs in the edge's thread then, and its time (measured) is added to the pass's,
    as a verifier's host drafts before the pass (since 2026-12-02: a GPU's pass is only a few milliseconds)."""

    def __init__(self, *args, warm: WarmDrafters | None = None, **kwargs) -> None:
        """`warm`: the verifier's drafting state kept across the client's sessions, as the served verifier keeps
        it (None: every session's verifier drafter starts fresh)."""
        super().__init__(*args, **kwargs)
        self._free_at = 0.0  # perf_counter time the verifier's last pass ends
        self._verdicts: deque[tuple[float, StepResult]] = deque()  # (when it is back, the verdict), in order
        self._filler: VerifierDrafter | None = None
        self._warm = warm

    def step(self, tree: DraftTree) -> StepResult:
        self.send(tree)
        return self.receive()

    def send(self, tree: DraftTree, root_length: int | None = None, fill_tokens: int = 0) -> None:
        sent_at = time.perf_counter()
        if root_length and self.done >= len(self.output):  # ahead of the verdict that ended it: an empty verdict
            self._verdicts.append((sent_at + self.rtt_ms / 1e3, StepResult(tokens=[], accepted=[], compute_ms=0.0)))
            return
        prefill_ms = self._prefill_ms()
        tree = DraftTree(tree.tokens, tree.parents, tree.proposals, tree.accept_probs)  # as the wire carries it
        if root_length:
            tree = tree.after(self.output[root_length - len(self.prompt_ids) : self.done])
        client_nodes = list(range(len(tree)))
        drafting = time.perf_counter()
        if fill_tokens > 0:
            if self._filler is None:
                top_k = DEFAULT_HINTS_TOP_K if self.hints is not None or self.model_hints is not None else 0
                self._filler = VerifierDrafter(self.prompt_ids, self.params, top_k, self.output[: self.done],
                                               self._warm)
            # (one token of the budget left over, as the service leaves it)
            filled = self._filler.draft(min(fill_tokens, MAX_TREE_NODES), self.cost, tree,
                                        max_depth=len(self.output) - self.done - 2)
            tree, client_nodes = filled.tree, filled.client_nodes
        drafting = time.perf_counter() - drafting
        result = self._verify(tree)
        if self._filler is not None:
            start = time.perf_counter()
            self._filler.observe(tree, Verdict(result.accepted, result.tokens, result.tokens[-1], result.hints))
            drafting += time.perf_counter() - start
        accepted, hints, drafted = client_share(result.accepted, result.hints, client_nodes)  # as the client reads it
        result = replace(result, accepted=accepted, hints=hints, verifier_drafted=drafted)
        arrives = sent_at + self.rtt_ms / 2e3
        starts = max(arrives, self._free_at)
        # The verifier's host drafts before the pass and learns after it: its time adds to the pass's (measured
        # here, on this machine, where it was done).
        self._free_at = starts + (prefill_ms + result.compute_ms) / 1e3 + drafting
        self._verdicts.append((self._free_at + self.rtt_ms / 2e3, replace(result, queue_ms=(starts - arrives) * 1e3)))

    def close(self) -> None:
        super().close()
        if self._filler is not None:
            self._filler.end()
            self._filler = None

    def receive(self) -> StepResult:
        back_at, result = self._verdicts.popleft()
        if (wait := back_at - time.perf_counter()) > 0:
            time.sleep(wait)
        return result


@dataclass
class Recorded:
    """The prompts of a recorded run (in Spec-Bench order) with their token ids and recorded greedy outputs."""

    prompts: list
    prompt_ids: dict[str, list[int]]
    refs: dict[str, list[int]]
    tokenizer: object  # the edge's tokenizer
    hf_tokenizer: object
    eos_ids: list[int]

    @classmethod
    def load(cls, runs: Path, model: str, chat: bool, categories: str | None = None, skip_per_category: int = 0
             ) -> Recorded:
        from transformers import AutoTokenizer

        from specedge.cloud.model_registry import resolve_model_dir
        from specedge.edge.tokenizer import EdgeTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
        tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
        refs = references(runs)
        seen: dict[str, int] = defaultdict(int)
        prompts = []
        for p in specbench.load(categories=categories.split(",") if categories else None):
            if p.id in refs:
                seen[p.category] += 1
                if seen[p.category] > skip_per_category:
                    prompts.append(p)
        eos_ids = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        prompt_ids = {p.id: tokenizer.encode_prompt(p.text, chat=chat) for p in prompts}
        return cls(prompts, prompt_ids, refs, tokenizer, hf_tokenizer, eos_ids)


def references(runs: Path) -> dict[str, list[int]]:
    """prompt id -> the greedy output of the run's `ar` (or `server-ar`) method (first repetition)."""
    out = {}
    for line in runs.read_text().splitlines():
        r = json.loads(line)
        if r["method"] in ("ar", "server-ar") and r["prompt"] not in out:
            out[r["prompt"]] = r["tokens"]
    return out


def recorded_hints(runs: Path, model_name: str, prompts: dict[str, list[int]], refs: dict[str, list[int]],
                   k: int = DEFAULT_HINTS_TOP_K) -> dict[str, Hints]:
    """prompt id -> the target's top k at every position of its recorded output, computed with the model
    in one forward per prompt and cached in a file next to `runs`."""
    cache = runs.with_name(f"{runs.stem}.hints-k{k}.json")
    known = json.loads(cache.read_text()) if cache.exists() else {}
    missing = [p for p in prompts if p not in known]
    if missing:
        import torch

        from specedge.cloud.hints import top_k_hints
        from specedge.cloud.model_registry import load_model

        model = load_model(model_name)[0]
        for n, p in enumerate(missing, 1):
            print(f"hints: {n}/{len(missing)} {p}", file=sys.stderr)
            ids = prompts[p] + refs[p][:-1]
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0, len(prompts[p]) - 1 :]
            h = top_k_hints(logits, k)
            known[p] = {"ids": h.ids, "probs": [[round(x, 4) for x in row] for row in h.probs]}
        cache.write_text(json.dumps(known))
    return {p: Hints(known[p]["ids"], known[p]["probs"]) for p in prompts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, help="runs.jsonl of a `specedge bench` run that included `ar`")
    ap.add_argument("--drafters", default="retrieval,suffix",
                    help="comma-separated; NAME~ is an A/A copy of NAME (bench/perturbed.py), NAME@N sends N nodes "
                         "a round (a fixed tree size, as `specedge bench --tree-size N`)")
    ap.add_argument("--max-tree", type=int, default=MAX_TREE_NODES)
    ap.add_argument("--model", default="smollm2-135m", help="the target (its tokenizer)")
    ap.add_argument("--chat", action="store_true", help="the prompts in the model's chat template (as the run had)")
    ap.add_argument("--categories", default=None, help="comma-separated: only these Spec-Bench categories")
    ap.add_argument("--skip-per-category", type=int, default=0, metavar="K",
                    help="leave out each category's first K prompts (e.g. those a benchmark reports)")
    ap.add_argument("--base-ms", type=float, default=BASE_MS, help="a plain decoding pass of the target")
    ap.add_argument("--timed", action="store_true", help="passes take their time for real (see above)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="with --timed: a network round trip per pass")
    ap.add_argument("--serial", action="store_true",
                    help="with --timed: no trees sent ahead, every round waits for the verdict before it")
    ap.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT,
                    help="with --timed: trees in flight at most (TreeSizeController.depth; 2: one ahead, as before "
                         "2026-12-02)")
    ap.add_argument("--cold-verifier", action="store_true",
                    help="with --timed: the verifier's own drafter (for trees ahead with nothing left) starts fresh "
                         "in every session, instead of keeping its state across the client's sessions as the "
                         "served verifier does (cloud/verifier_drafter.py, WarmDrafters)")
    ap.add_argument("--hints", choices=("on-path", "model"), default=None,
                    help="verdicts carry the verifier's hints (see above); the first one also at the prompt's "
                         "positions, from the engine's prefill (cloud/prompt_hints.py)")
    ap.add_argument("--no-prompt-hints", action="store_true",
                    help="with --hints: none at the prompt's positions (as before 2026-12-07's sixtieth session)")
    ap.add_argument("--out", type=Path, default=None, metavar="RUNS.jsonl",
                    help="also write a row per generation (and one per prompt for plain decoding, method `ar`, "
                         "its modelled time) that bench/category_intervals.py reads, with the generation's "
                         "rounds: how many, how many went ahead, the tokens the verifier drafted, the tree sizes "
                         "verified and the nodes accepted per round")
    ap.add_argument("--by-source", action="store_true",
                    help="also print, per retrieval drafter, its nodes' acceptance by source and depth")
    ap.add_argument("--oracle", default=None, metavar="COST",
                    help="also print what a perfect choice among each drafter's nodes would commit: tokens per "
                         "pass sending only the accepted path's first n nodes, and the decode speedup of sending "
                         "it whole, priced by COST (a --cost spec, its passes without hints: their share of a "
                         "pass is under 2%%). Meaningful where the rounds drafted large trees: with --cost flat")
    ap.add_argument("--cost", default="cpu", metavar="cpu|flat|cpu:FILE:MODEL|gpu:FILE:SHAPE",
                    help="pass cost by tree size: this CPU's (cloud/cost_tracker.py's prior, scaled to --base-ms), "
                         "flat (every tree costs one plain pass), MODEL's greedy steps as bench/engine_bench.py "
                         "measured them here (its results.json), or what a GPU measured for SHAPE, one session at "
                         "the context nearest the prompt's (bench/gpu_bench.py's JSON; with --hints, its passes "
                         "with hints): plain decoding then costs the measured one-token pass, not --base-ms")
    args = ap.parse_args()
    recorded = Recorded.load(args.runs, args.model, args.chat, args.categories, args.skip_per_category)
    prompts, prompt_ids, refs = recorded.prompts, recorded.prompt_ids, recorded.refs
    tokenizer, hf_tokenizer, eos_ids = recorded.tokenizer, recorded.hf_tokenizer, recorded.eos_ids
    cost_of = replay_costs(args.cost, args.base_ms, DEFAULT_HINTS_TOP_K if args.hints else 0)
    hints = recorded_hints(args.runs, args.model, prompt_ids, refs) if args.hints == "on-path" else {}
    model_hints = ModelHints.beside(args.runs, args.model) if args.hints == "model" else None
    at_prompt = ModelHints.beside(args.runs, args.model) if args.hints and not args.no_prompt_hints else None
    totals: dict[tuple[str, str], Totals] = defaultdict(Totals)
    # Timed rows carry the round trip, plain decoding's too (bench/category_intervals.py pairs rows by it).
    network = {"rtt_ms": args.rtt_ms} if args.timed else {}
    plain_ms = {p.id: cost_of(len(prompt_ids[p.id])).ms(0) for p in prompts}  # plain decoding's pass
    rows = [generation_row("ar", p, refs[p.id], (len(refs[p.id]) - 1) * plain_ms[p.id]) | network for p in prompts]
    if args.timed and args.rtt_ms:  # a remote client asking for one token a round trip (modelled, not replayed)
        rows += [generation_row("remote-ar", p, refs[p.id], (len(refs[p.id]) - 1) * (plain_ms[p.id] + args.rtt_ms))
                 | network for p in prompts]
    by_source: dict[str, dict] = {}
    oracle_cost = replay_costs(args.oracle, args.base_ms) if args.oracle else None
    oracle: dict[str, Oracle] = defaultdict(Oracle)
    for name in args.drafters.split(","):
        if name == "suffix":
            from specedge.bench.suffix_drafter import SuffixDecodingDrafter

            drafter, controller = SuffixDecodingDrafter(max_spec_tokens=min(args.max_tree, 16)), None
        else:
            base, _, fixed = name.partition("@")
            drafter = make_drafter(base.removesuffix(MARK), max_nodes=args.max_tree, tokenizer=tokenizer,
                                   eos_ids=eos_ids)
            if base.endswith(MARK):  # an A/A copy (bench/perturbed.py)
                drafter = perturb(drafter, tokenizer)
            controller = TreeSizeController(args.max_tree, fixed=int(fixed) if fixed else None,
                                            max_in_flight=args.max_in_flight)
        warm = None if args.cold_verifier else WarmDrafters(ServerConfig.warm_drafter_clients)  # this client's
        for n, p in enumerate(prompts, 1):  # one drafter through all prompts in order, as in the benchmark's repetition
            ids = prompt_ids[p.id]
            wants = hints_wanted(drafter) > 0
            session_args = (ids, refs[p.id], len(hf_tokenizer), cost_of(len(ids)), args.timed, args.rtt_ms,
                            hints.get(p.id) if wants else None, model_hints if wants else None,
                            at_prompt.at_prompt(ids) if wants and at_prompt is not None else None)
            if args.timed and not args.serial:
                session = PipelinedReplaySession(*session_args, warm=warm)
            else:
                session = ReplaySession(*session_args)
            r = generate(session, (), drafter, controller)
            assert r.token_ids == refs[p.id]
            decode_ms = (r.wall_s - r.ttft_s) * 1e3 if args.timed else sum(session.pass_ms[1:]) + sum(r.draft_ms[1:])
            for key in ((name, p.category), (name, "all")):  # the first pass (the prefill) left out
                totals[key].add(len(r.token_ids) - 1, r.rounds - 1, decode_ms, sum(r.tree_sizes[1:]), r.draft_ms[1:],
                                r.ahead, (len(r.token_ids) - 1) * plain_ms[p.id])
            if oracle_cost is not None:
                oracle[name].add(r.accepted[1:], oracle_cost(len(ids)))
            row = generation_row(name, p, r.token_ids, decode_ms) | {
                "rounds": r.rounds, "ahead": r.ahead, "verifier_drafted": r.verifier_drafted,
                "tree_sizes": r.tree_sizes, "accepted": r.accepted}
            if args.timed:  # each round's times, as `specedge bench` writes them (bench/verifier_idle.py reads them)
                row |= network | {"draft_ms": r.draft_ms, "compute_ms": r.compute_ms, "sent_ms": r.sent_ms,
                                  "verdict_ms": r.verdict_ms}
            rows.append(row)
            if args.timed:  # (minutes per drafter: say how far it is)
                print(f"[{n}/{len(prompts)}] {name} {p.category}/{p.id}: {r.rounds} rounds, {r.wall_s:.1f} s",
                      file=sys.stderr)
        retrieval = drafter.sources[0] if hasattr(drafter, "sources") else drafter
        by_source[name] = getattr(retrieval, "verdicts_by_source", {})
    # Draft ms: the median round's drafting time, and the mean (a model drafting in some rounds only); ahead:
    # the share of rounds whose tree went out ahead of the verdict before it.
    print(f"{'drafter':<18}{'category':<16}{'accepted/pass':>14}{'nodes/pass':>11}{'decode x':>9}{'draft ms':>9}"
          f"{'mean':>7}{'ahead':>7}")
    for (name, cat), t in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        # Plain decoding: one one-token pass per token (and, over a network, one round trip for the whole answer).
        speedup = t.plain_ms / t.decode_ms
        print(f"{name:<18}{cat:<16}{t.tokens / t.rounds:>14.3f}{t.nodes / t.rounds:>11.2f}{speedup:>9.2f}"
              f"{statistics.median(t.draft_ms):>9.2f}{statistics.mean(t.draft_ms):>7.1f}{t.ahead / t.rounds:>7.2f}")
    if args.timed and args.rtt_ms:
        remote = sum(r["wall_s"] for r in rows if r["method"] == "remote-ar") * 1e3
        plain = sum(r["wall_s"] for r in rows if r["method"] == "ar") * 1e3
        print(f"{'remote-ar':<18}{'all':<16}{1.0:>14.3f}{0.0:>11.2f}{plain / remote:>9.2f}{0.0:>9.2f}{0.0:>7.1f}"
              f"{0.0:>7.2f}")
        print(f"remote-ar: modelled, not replayed: a one-token pass and a {args.rtt_ms:g} ms round trip per token",
              file=sys.stderr)
    if args.by_source:
        print_by_source(by_source)
    if oracle:
        print_oracle(oracle, args.oracle)
    if args.out is not None:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))


def replay_costs(spec: str, base_ms: float, hints: int = 0) -> Callable[[int], CostModel]:
    """Prompt tokens -> the pass cost model, from `--cost`: `cpu` (this CPU's prior curve scaled to `base_ms`), `flat`
    (every tree `base_ms`) or `gpu:FILE:SHAPE` (bench/gpu_costs.py; `hints`: the passes measured with that many hint
    tokens a row)."""
    if spec in ("cpu", "flat"):
        cost = CostModel(tuple((n, base_ms * (r if spec == "cpu" else 1.0)) for n, r in PRIOR_RELATIVE.items()))
        return lambda context: cost
    kind, _, rest = spec.partition(":")
    path, _, shape = rest.rpartition(":")
    if kind not in ("cpu", "gpu") or not path or not shape:
        raise SystemExit(f"--cost {spec!r}: expected cpu, flat, cpu:FILE:MODEL or gpu:FILE:SHAPE")
    if kind == "cpu" and hints:
        raise SystemExit(f"--cost {spec!r}: bench/engine_bench.py measures its steps without hints")
    try:
        if kind == "cpu":
            cost = greedy_step_costs(Path(path), shape)
            return lambda context: cost
        return pass_costs(Path(path), shape, hints)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--cost {spec!r}: {e}") from None


def greedy_step_costs(path: Path, model: str) -> CostModel:
    """`model`'s greedy steps by draft tokens as bench/engine_bench.py measured them on this CPU (its results.json:
    the real model, its int8 argmax included), never cheaper for more tokens (a step's time swings by ~15%)."""
    rows = json.loads(path.read_text())["models"][model]["verify_cost"]
    points, last = [], 0.0
    for r in sorted(rows, key=lambda r: r["tree_tokens"]):
        last = max(last, r["greedy_ms"])
        points.append((r["tree_tokens"], last))
    if not points or points[0][0] != 0:
        raise ValueError(f"{path}: {model}'s steps start at {points[0][0] if points else 'no'} draft tokens; "
                         "the replay prices plain decoding by a step of 0 (engine_bench.py --tree-tokens 0,...)")
    return CostModel(tuple(points))


def generation_row(method: str, prompt, tokens: list[int], decode_ms: float) -> dict:
    """A runs.jsonl row as bench/category_intervals.py reads it: the first token (the prefill's) left out of
    both the tokens and the time, as in the printed speedups."""
    return {"method": method, "prompt": prompt.id, "category": prompt.category, "tokens": tokens[1:],
            "wall_s": decode_ms / 1e3}


def print_by_source(by_source: dict[str, dict]) -> None:
    """Reached nodes and the share accepted, by the source that proposed them and their depth (6 = 6+)."""
    print(f"\n{'drafter':<18}{'source':<10}" + "".join(f"{'depth ' + str(d):>16}" for d in range(1, 7)))
    for name, counts in by_source.items():
        for source in ("retrieval", "table", "both"):
            cells = []
            for d in range(1, 7):
                reached = sum(c[0] for (s, depth), c in counts.items() if s == source and min(depth, 6) == d)
                accepted = sum(c[1] for (s, depth), c in counts.items() if s == source and min(depth, 6) == d)
                cells.append(f"{accepted / reached:.2f} of {reached}" if reached else "-")
            if any(c != "-" for c in cells):
                print(f"{name:<18}{source:<10}" + "".join(f"{c:>16}" for c in cells))


ORACLE_BUDGETS = (2, 4, 6, 8, 12, 16)


@dataclass
class Oracle:
    """Where a drafter's tokens are lost, choice or candidates: per round, the accepted path's length L in the
    tree it sent. A perfect choice of n nodes among the same ones sends the path's first n and commits
    min(L, n) + 1; sent whole, the path commits L + 1 at a pass of L nodes. (Each round's text is the one this
    drafter reached with its own trees: an estimate of what a run choosing differently would see.)"""

    paths: list[int] = field(default_factory=list)
    plain_ms: float = 0.0  # the tokens those rounds commit, at one plain pass each
    path_ms: float = 0.0  # the rounds' passes, each of its accepted path alone

    def add(self, accepted: list[int], cost: CostModel) -> None:
        self.paths += accepted
        self.plain_ms += sum(n + 1 for n in accepted) * cost.ms(0)
        self.path_ms += sum(cost.ms(n) for n in accepted)

    def tokens_per_pass(self, budget: int) -> float:
        return 1 + sum(min(n, budget) for n in self.paths) / max(1, len(self.paths))


def print_oracle(oracle: dict[str, Oracle], cost: str) -> None:
    print(f"\n{'drafter':<18}{'perfect choice: tokens per pass at n nodes':<44}{'path whole':>11}"
          f"{'decode x':>9}  (priced by {cost})")
    print(f"{'':<18}" + "".join(f"{'n=' + str(n):>7}" for n in ORACLE_BUDGETS) + f"{'':<2}"
          f"{'tok/pass':>11}")
    for name, o in oracle.items():
        print(f"{name:<18}" + "".join(f"{o.tokens_per_pass(n):>7.3f}" for n in ORACLE_BUDGETS) + f"{'':<2}"
              f"{o.tokens_per_pass(1 << 30):>11.3f}{o.plain_ms / o.path_ms:>9.2f}")


@dataclass
class Totals:
    tokens: int = 0
    rounds: int = 0
    decode_ms: float = 0.0  # after the first pass: passes and drafting (measured by the clock with --timed)
    nodes: int = 0
    draft_ms: list[float] = field(default_factory=list)
    ahead: int = 0  # rounds whose tree went out ahead of the verdict before it
    plain_ms: float = 0.0  # plain decoding's modelled time for the same tokens

    def add(self, tokens: int, rounds: int, decode_ms: float, nodes: int, draft_ms: list[float], ahead: int,
            plain_ms: float) -> None:
        self.tokens, self.rounds = self.tokens + tokens, self.rounds + rounds
        self.decode_ms, self.nodes = self.decode_ms + decode_ms, self.nodes + nodes
        self.draft_ms += draft_ms
        self.ahead += ahead
        self.plain_ms += plain_ms


if __name__ == "__main__":
    main()
