"""Drafting cost at scale (issue 3): build a long-term datastore of ~10M tokens from text files, then time
the retrieval drafter's rounds with a 100k-token short-term context and that datastore.

The drafter runs twice side by side, rounds interleaved: without hints, and with hints (common/hints.py)
for the root and every node sent in each verdict, as a verifier's would, so that it also grows its trees
from a full recycling table (issue 11). Those hints are made up, not a model's (no model runs here): the
true next token first at the root, then tokens drawn from the text, with falling probabilities; what is
timed is the drafting work a full table causes.

    .venv/bin/python bench/drafting_bench.py --tokens 10000000 --context 100000 --out bench-out/drafting

The corpus is real English text: Spec-Bench's questions, split into sentences and reshuffled into
documents until the wanted size is reached (written as files, so the build includes tokenisation).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specedge.bench import specbench
from specedge.cloud.model_registry import load_model
from specedge.common.hints import DEFAULT_HINTS_TOP_K
from specedge.edge.corpus import build_datastore
from specedge.edge.datastore import Datastore
from specedge.edge.retrieval import RetrievalDrafter
from specedge.edge.tokenizer import EdgeTokenizer


def write_corpus(out: Path, approx_chars: int, seed: int = 0) -> list[Path]:
    sentences = [s for p in specbench.load() for s in re.split(r"(?<=[.!?])\s+", p.text) if len(s) > 20]
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    files, written, n = [], 0, 0
    while written < approx_chars:
        doc = " ".join(rng.choice(sentences) for _ in range(rng.randint(20, 60)))
        path = out / f"doc{n // 1000:04d}.txt"
        with open(path, "a") as f:
            f.write(doc + "\n\n")
        if path not in files:
            files.append(path)
        written += len(doc)
        n += 1
    return files


def _classes(package: str) -> dict:
    """The classes a drafting round uses, from `package` (this one, or a commit's: _package_at)."""
    modules = {"RetrievalDrafter": "edge.retrieval", "Datastore": "edge.datastore", "Hints": "common.hints",
               "StepResult": "common.session", "TreeSizeController": "edge.controller",
               "CostTracker": "cloud.cost_tracker"}
    return {name: getattr(importlib.import_module(f"{package}.{module}"), name) for name, module in modules.items()}


def _package_at(commit: str, workdir: Path) -> str:
    """The repository's files at `commit`, importable as the package specedge_<commit>."""
    name = "specedge_" + re.sub(r"\W", "_", commit)
    if not (workdir / name).exists():
        workdir.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", f"--prefix={name}/", commit], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive.stdout, check=True)
        for path in (workdir / name).rglob("*.py"):
            path.write_text(re.sub(r"\bspecedge(?=[. ])", name, path.read_text()))
    sys.path.insert(0, str(workdir))
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=10_000_000, help="approximate datastore size in tokens")
    ap.add_argument("--context", type=int, default=100_000, help="short-term context tokens")
    ap.add_argument("--rounds", type=int, default=300, help="drafting rounds to time")
    ap.add_argument("--out", type=Path, default=Path("bench-out/drafting"))
    ap.add_argument("--against", metavar="COMMIT",
                    help="also time that commit's drafters (its files imported as another package), rounds "
                         "interleaved with this tree's: a machine's speed drifts by tens of percent between runs")
    args = ap.parse_args()
    tokenizer = EdgeTokenizer.from_transformers(load_model(args.model)[1])
    corpus_dir = args.out / "corpus"
    if not corpus_dir.exists():
        write_corpus(corpus_dir, approx_chars=int(args.tokens * 4.4))  # ~4.3 characters per token here
    store_dir = args.out / "store"
    t0 = time.perf_counter()
    meta = build_datastore([corpus_dir], tokenizer, store_dir)
    build_s = time.perf_counter() - t0
    store = Datastore(store_dir)

    # The short-term context: real text, then "generation" continues with text that partly repeats it.
    text_ids = np.asarray(store.corpus[: args.context + 50_000], dtype=np.int64)
    text_ids = text_ids[text_ids >= 0]
    context, future = text_ids[: args.context].tolist(), text_ids[args.context :].tolist()
    k = DEFAULT_HINTS_TOP_K
    probs = [0.5 / 2**i for i in range(k)]

    def rounds(pkg: dict, hints_top_k: int, times: list[float], sizes: list[int], sent_trees: list):
        """Draft, verify against the text, commit; yields after each round. `pkg`: the classes to use."""
        drafter = pkg["RetrievalDrafter"](datastore=pkg["store"], hints_top_k=hints_top_k)
        drafter.begin(context)
        controller, costs, pos = pkg["TreeSizeController"](), pkg["CostTracker"](), 0
        rng = np.random.default_rng(0)  # the same made-up hints for every drafter
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            draft = drafter.propose()
            n = controller.choose(draft, costs.model(), 128)
            times.append((time.perf_counter() - t0) * 1e3)
            sizes.append(len(draft))
            sent = draft.prefix(n)
            sent_trees.append((sent.tokens, sent.parents))
            # Accept the longest true path, as a verifier would, then the true next token.
            kids, node, accepted = sent.children(), -1, []
            while pos + len(accepted) < len(future):
                c = next((c for c in kids[node + 1] if sent.tokens[c] == future[pos + len(accepted)]), None)
                if c is None:
                    break
                accepted.append(c)
                node = c
            new = future[pos : pos + len(accepted) + 1]
            hints = None
            if hints_top_k:
                ids = [list(dict.fromkeys(row)) for row in rng.choice(text_ids, size=(1 + len(sent), k)).tolist()]
                ids[0] = [new[0]] + [t for t in ids[0] if t != new[0]][: k - 1]  # distinct, as a top k is
                hints = pkg["Hints"](ids, [probs[: len(row)] for row in ids])
            drafter.observe(sent, pkg["StepResult"](tokens=new, accepted=accepted, compute_ms=0.0, hints=hints))
            pos += len(new)
            yield

    t0 = time.perf_counter()
    RetrievalDrafter().begin(context)
    index_s = time.perf_counter() - t0
    packages = {"": _classes("specedge")}
    if args.against:
        packages["@" + args.against] = _classes(_package_at(args.against, args.out / "against"))
    timings = {}
    for suffix, pkg in packages.items():
        pkg["store"] = pkg["Datastore"](store_dir)  # one per package, its drafters sharing it, as ever
        for name, hints_top_k in (("no_hints", 0), ("hints", k)):
            loop = rounds(pkg, hints_top_k, times := [], sizes := [], sent := [])
            timings[name + suffix] = (loop, times, sizes, sent)
    loops = [loop for loop, *_ in timings.values()]
    for r in range(args.rounds):  # one round of each in turn, the order reversed every other round
        for loop in loops if r % 2 == 0 else loops[::-1]:
            next(loop)
    result = {
        "datastore_tokens": meta["num_tokens"], "datastore_build_s": round(build_s, 2),
        "suffix_sort_s": meta["suffix_sort_s"], "bytes_per_token": meta["bytes_per_token"],
        "context_tokens": len(context), "context_index_s": round(index_s, 3), "rounds": args.rounds,
        "hints_top_k": k,
    }
    for name, (_, times, sizes, _) in timings.items():
        result |= {f"draft_ms_median_{name}": round(statistics.median(times), 3),
                   f"draft_ms_p90_{name}": round(float(np.percentile(times, 90)), 3),
                   f"draft_nodes_median_{name}": statistics.median(sizes)}
    if args.against:  # the same drafts, or the comparison is of different work
        for name in ("no_hints", "hints"):
            same = sum(a == b for a, b in zip(timings[name][3], timings[f"{name}@{args.against}"][3]))
            result[f"rounds_sending_the_same_tree_{name}"] = f"{same} of {args.rounds}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
