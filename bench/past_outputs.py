"""Write earlier answers to Spec-Bench prompts as a JSON-lines corpus of "past outputs" for the long-term
datastore: the situation of an edge device (or a fleet sharing a datastore) that has answered questions
about the same documents before. The answers are *sampled* (not the greedy answers a benchmark later
checks against), so the datastore holds related text, not the answer itself.

    .venv/bin/python bench/past_outputs.py --category rag --per-category 6 --samples 2 -o bench-out/rag-past.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specedge.bench import specbench
from specedge.cloud.engine import Engine
from specedge.cloud.local import LocalVerifier
from specedge.cloud.model_registry import eos_token_ids, load_model
from specedge.common.params import SamplingParams
from specedge.edge.generation import generate
from specedge.edge.tokenizer import EdgeTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--category", default="rag")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--samples", type=int, default=2, help="sampled answers per prompt")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    hf, hf_tokenizer = load_model(args.model)
    tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
    verifier = LocalVerifier(Engine.from_hf_model(hf, kv_pool_bytes=512 << 20))
    prompts = specbench.load(categories=[args.category])[: args.per_category]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for p in prompts:
            ids = tokenizer.encode_prompt(p.text, chat=True)
            for seed in range(args.samples):
                params = SamplingParams(temperature=args.temperature, seed=1000 + seed,
                                        max_new_tokens=args.max_new_tokens)
                r = generate(verifier.open(ids, params), eos_token_ids(hf))
                text = tokenizer.decode(r.token_ids)
                f.write(json.dumps({"id": p.id, "seed": 1000 + seed, "text": text}) + "\n")
                print(f"{p.category}/{p.id} sample {seed}: {len(r.token_ids)} tokens", flush=True)


if __name__ == "__main__":
    main()
