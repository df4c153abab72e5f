"""What drafters commit per pass, with no timing in it: each drafter generates every prompt in turn on one
in-process verifier, carrying its state from prompt to prompt as `specedge bench` does, its trees sized by
the controller priced with a stated cost model (PASS) instead of measured pass times. Retrieval's trees are
then a function of the prompts and its state alone; a hybrid's model still speculates for as long as each
pass takes. Per category: tokens per pass of each drafter; per prompt, each drafter's passes against the
first's. With an A/A copy among the drafters (`retrieval~`, bench/perturbed.py), the spread between it
and its original is what drafter state alone does to these figures.

    python -m specedge.bench.tokens_per_pass PROMPTS.jsonl --drafters retrieval,hybrid,retrieval~
        [--model gemma3-270m] [--max-new-tokens 96] [--out per-round.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from specedge.common.cost_model import CostModel
from specedge.edge.controller import TreeSizeController

PASS = CostModel(((0, 25.0), (64, 60.0)))  # ms by tree tokens: about gemma3-270m's pass on one core of this host
OVERHEAD_MS = 2.0  # a round's time besides the pass


class PricedController(TreeSizeController):
    """The controller with the pass's cost and the round's overhead stated, not measured."""

    def __init__(self, max_nodes: int) -> None:
        super().__init__(max_nodes, overhead_ms=OVERHEAD_MS, alpha=0.0)

    def choose(self, draft, cost, remaining) -> int:
        return super().choose(draft, PASS, remaining)


def passes_against(rounds: dict[str, dict[str, int]], method: str, reference: str) -> tuple[float, float, float]:
    """Over prompts, of `method`'s passes / `reference`'s: (the geometric mean, the standard deviation of the
    log ratio: how far one prompt's figure moves, and the standard error of its mean)."""
    logs = [math.log(by[method] / by[reference]) for by in rounds.values()]
    sd = statistics.stdev(logs) if len(logs) > 1 else float("nan")
    return math.exp(statistics.fmean(logs)), sd, sd / math.sqrt(len(logs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", type=Path, help="jsonl: Spec-Bench lines (turns, category) or {prompt, category}")
    p.add_argument("--drafters", default="retrieval,hybrid,retrieval~")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-tree", type=int, default=64)
    p.add_argument("--out", type=Path, help="write every generation's rounds here (jsonl)")
    args = p.parse_args(argv)

    from specedge.bench import perturbed
    from specedge.bench.workloads import load_prompts
    from specedge.cloud.engine import Engine
    from specedge.cloud.local import LocalVerifier
    from specedge.cloud.model_registry import eos_token_ids, load_model
    from specedge.common.params import SamplingParams
    from specedge.edge.drafter import hints_wanted
    from specedge.edge.generation import generate
    from specedge.edge.tokenizer import EdgeTokenizer

    perturbed.install()
    from specedge.edge.registry import make_drafter

    prompts = load_prompts(argparse.Namespace(prompts=args.prompts, workload=None))
    names = [n for n in args.drafters.split(",") if n]
    hf, hf_tokenizer = load_model(args.model)
    tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=512 << 20)
    verifier, eos = LocalVerifier(engine), eos_token_ids(hf)
    drafters = {n: make_drafter(n, None, max_nodes=args.max_tree, tokenizer=tokenizer, eos_ids=eos) for n in names}
    controllers = {n: PricedController(args.max_tree) for n in names}
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (drafter, category) -> tokens, passes
    rounds: dict[str, dict[str, int]] = {}  # prompt -> drafter -> passes
    out = args.out.open("w") if args.out else None
    for n, q in enumerate(prompts, start=1):
        category = q.category
        ids = tokenizer.encode_prompt(q.text)
        reference = None
        for name in names:
            engine.pool.drop_cached()
            params = SamplingParams(max_new_tokens=args.max_new_tokens)
            drafter = drafters[name]
            r = generate(verifier.open(ids, params, hints_wanted(drafter)), eos, drafter, controllers[name])
            reference = r.token_ids if reference is None else reference
            if r.token_ids != reference:
                raise SystemExit(f"prompt {n}: {name}'s output differs from {names[0]}'s")
            totals[(name, category)][0] += r.num_tokens
            totals[(name, category)][1] += r.rounds
            rounds.setdefault(str(n), {})[name] = r.rounds
            if out:
                out.write(json.dumps({"prompt": n, "category": category, "drafter": name, "tree_sizes": r.tree_sizes,
                                      "accepted": r.accepted}) + "\n")
        print(f"[{n}/{len(prompts)}] {category}: " + ", ".join(f"{m} {rounds[str(n)][m]} passes" for m in names),
              flush=True)
    if out:
        out.close()
    print("| category | " + " | ".join(f"{m} tokens/pass" for m in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for category in dict.fromkeys(q.category for q in prompts):
        print(f"| {category} | " + " | ".join(f"{t / p:.3f}" for t, p in (totals[(m, category)] for m in names)) + " |")
    for name in names[1:]:
        ratio, sd, se = passes_against(rounds, name, names[0])
        print(f"{name} / {names[0]}, passes per prompt: {ratio:.3f} (geometric mean, 95%: x/ {math.exp(2 * se):.3f});"
              f" one prompt's ratio spreads by {sd:.1%} (sd of its log)")


if __name__ == "__main__":
    main()
