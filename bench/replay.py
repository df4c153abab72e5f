"""Replay recorded greedy generations against drafters, without the model: how many tokens each drafter
would commit per pass, and the decode speedup the verifier's cost model predicts for the trees it sends.

A greedy verifier accepts exactly the draft path that spells the model's own continuation, so a recorded
greedy output (the `ar` rows of a `specedge bench` run's runs.jsonl) answers every verification a drafter
could ask for. That makes drafter work a seconds-long loop instead of a half-hour benchmark; the real
benchmark (`specedge bench`) still decides, since it also pays real pass and drafting times.

    .venv/bin/python bench/replay.py bench-out/spec-main/runs.jsonl --workload specbench:summarization,rag
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from specedge.bench import specbench
from specedge.cloud.cost_tracker import PRIOR_RELATIVE
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.controller import TreeSizeController
from specedge.edge.generation import generate
from specedge.edge.registry import make_drafter

BASE_MS = 55.0  # a plain decoding pass of SmolLM2-135M here (BENCHMARKS.md section 1)


class ReplaySession:
    """A verifier session that answers from a recorded greedy output; passes cost what the prior says."""

    def __init__(self, prompt_ids: list[int], output: list[int], vocab_size: int, cost: CostModel) -> None:
        self.prompt_ids, self.output, self.vocab_size, self.cost = list(prompt_ids), list(output), vocab_size, cost
        self.params = SamplingParams(max_new_tokens=len(output))
        self.max_tree_tokens = 1 << 30
        self.done = 0
        self.pass_ms: list[float] = []

    def step(self, tree: DraftTree) -> StepResult:
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
        self.done += len(tokens)
        self.pass_ms.append(self.cost.ms(len(tree)))
        return StepResult(tokens=tokens, accepted=accepted, compute_ms=self.pass_ms[-1])

    def cost_model(self) -> CostModel:
        return self.cost

    def close(self) -> None:
        pass


def references(runs: Path) -> dict[str, list[int]]:
    """prompt id -> the greedy output of the run's `ar` method (first repetition)."""
    out = {}
    for line in runs.read_text().splitlines():
        r = json.loads(line)
        if r["method"] == "ar" and r["prompt"] not in out:
            out[r["prompt"]] = r["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, help="runs.jsonl of a `specedge bench` run that included `ar`")
    ap.add_argument("--drafters", default="retrieval,suffix")
    ap.add_argument("--max-tree", type=int, default=MAX_TREE_NODES)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cost", choices=("cpu", "flat"), default="cpu",
                    help="pass cost by tree size: this CPU's (cloud/cost_tracker.py's prior), or flat (every "
                         "tree costs one plain pass: a GPU-like verifier, where small trees are nearly free)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specedge.cloud.model_registry import resolve_model_dir
    from specedge.edge.tokenizer import EdgeTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
    refs = references(args.runs)
    prompts = [p for p in specbench.load() if p.id in refs]
    cost = CostModel(tuple((n, BASE_MS * (r if args.cost == "cpu" else 1.0)) for n, r in PRIOR_RELATIVE.items()))
    totals: dict[tuple[str, str], Totals] = defaultdict(Totals)
    for name in args.drafters.split(","):
        if name == "suffix":
            from specedge.bench.suffix_drafter import SuffixDecodingDrafter

            drafter, controller = SuffixDecodingDrafter(max_spec_tokens=min(args.max_tree, 16)), None
        else:
            drafter, controller = make_drafter(name, max_nodes=args.max_tree), TreeSizeController(args.max_tree)
        for p in prompts:  # one drafter through all prompts in order, as in the benchmark's repetition
            ids = tokenizer.encode_prompt(p.text, chat=True)
            session = ReplaySession(ids, refs[p.id], len(hf_tokenizer), cost)
            r = generate(session, (), drafter, controller)
            assert r.token_ids == refs[p.id]
            for key in ((name, p.category), (name, "all")):  # the first pass (the prefill) left out
                totals[key].add(len(r.token_ids) - 1, r.rounds - 1, sum(session.pass_ms[1:]),
                                sum(r.tree_sizes[1:]), r.draft_ms[1:])
    print(f"{'drafter':<14}{'category':<16}{'accepted/pass':>14}{'nodes/pass':>11}{'est. decode x':>14}{'draft ms':>9}")
    for (name, cat), t in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        speedup = t.tokens / (t.pass_ms + sum(t.draft_ms)) * BASE_MS  # plain decoding: one token per BASE_MS
        print(f"{name:<14}{cat:<16}{t.tokens / t.rounds:>14.3f}{t.nodes / t.rounds:>11.2f}{speedup:>14.2f}"
              f"{statistics.median(t.draft_ms):>9.2f}")


@dataclass
class Totals:
    tokens: int = 0
    rounds: int = 0
    pass_ms: float = 0.0
    nodes: int = 0
    draft_ms: list[float] = field(default_factory=list)

    def add(self, tokens: int, rounds: int, pass_ms: float, nodes: int, draft_ms: list[float]) -> None:
        self.tokens, self.rounds, self.pass_ms = self.tokens + tokens, self.rounds + rounds, self.pass_ms + pass_ms
        self.nodes += nodes
        self.draft_ms += draft_ms


if __name__ == "__main__":
    main()
