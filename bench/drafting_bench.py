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
import json
import random
import re
import statistics
import time
from pathlib import Path

import numpy as np

from specedge.bench import specbench
from specedge.cloud.cost_tracker import CostTracker
from specedge.cloud.model_registry import load_model
from specedge.common.hints import DEFAULT_HINTS_TOP_K, Hints
from specedge.common.session import StepResult
from specedge.edge.controller import TreeSizeController
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=10_000_000, help="approximate datastore size in tokens")
    ap.add_argument("--context", type=int, default=100_000, help="short-term context tokens")
    ap.add_argument("--rounds", type=int, default=300, help="drafting rounds to time")
    ap.add_argument("--out", type=Path, default=Path("bench-out/drafting"))
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
    rng = np.random.default_rng(0)
    k = DEFAULT_HINTS_TOP_K
    probs = [0.5 / 2**i for i in range(k)]

    def made_up_hints(rows: int, truth: int) -> Hints:
        ids = rng.choice(text_ids, size=(rows, k)).tolist()
        ids = [list(dict.fromkeys(row)) for row in ids]  # distinct tokens in a row, as a top k has
        ids[0] = [truth] + [t for t in ids[0] if t != truth][: k - 1]
        return Hints(ids, [probs[: len(row)] for row in ids])

    def rounds(drafter: RetrievalDrafter, times: list[float], sizes: list[int]):
        """Draft, verify against the text, commit; yields after each round."""
        controller, costs, pos = TreeSizeController(), CostTracker(), 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            draft = drafter.propose()
            n = controller.choose(draft, costs.model(), 128)
            times.append((time.perf_counter() - t0) * 1e3)
            sizes.append(len(draft))
            sent = draft.prefix(n)
            # Accept the longest true path, as a verifier would, then the true next token.
            kids, node, accepted = sent.children(), -1, []
            while pos + len(accepted) < len(future):
                c = next((c for c in kids[node + 1] if sent.tokens[c] == future[pos + len(accepted)]), None)
                if c is None:
                    break
                accepted.append(c)
                node = c
            new = future[pos : pos + len(accepted) + 1]
            hints = made_up_hints(1 + len(sent), new[0]) if drafter.hints_top_k else None
            drafter.observe(sent, StepResult(tokens=new, accepted=accepted, compute_ms=0.0, hints=hints))
            pos += len(new)
            yield

    timings = {}
    for name, hints_top_k in (("no_hints", 0), ("hints", k)):
        drafter = RetrievalDrafter(datastore=store, hints_top_k=hints_top_k)
        t0 = time.perf_counter()
        drafter.begin(context)
        index_s = time.perf_counter() - t0
        timings[name] = (rounds(drafter, times := [], sizes := []), times, sizes)
    for _ in zip(*(loop for loop, _, _ in timings.values())):  # one round of each in turn
        pass
    result = {
        "datastore_tokens": meta["num_tokens"], "datastore_build_s": round(build_s, 2),
        "suffix_sort_s": meta["suffix_sort_s"], "bytes_per_token": meta["bytes_per_token"],
        "context_tokens": len(context), "context_index_s": round(index_s, 3), "rounds": args.rounds,
        "hints_top_k": k,
    }
    for name, (_, times, sizes) in timings.items():
        result |= {f"draft_ms_median_{name}": round(statistics.median(times), 3),
                   f"draft_ms_p90_{name}": round(float(np.percentile(times, 90)), 3),
                   f"draft_nodes_median_{name}": statistics.median(sizes)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
