"""The edge's plain-Python tokenizer (edge/bpe_tokenizer.py) against the `tokenizers` library, side by side:
load time (from the JSON a verifier serves, and from the edge cache's compiled form), encoding speed on
Spec-Bench text (every prompt, one by one as prompts are, and joined into one document as a datastore's
files are; the word cache is emptied before each timing) and whether the ids agree.

    .venv/bin/python bench/tokenizer_bench.py --out bench-out/tokenizer
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import tokenizers
from transformers import AutoTokenizer

from specedge.bench import specbench
from specedge.cloud.model_registry import resolve_model_dir
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.edge.bpe_tokenizer import BpeTokenizer


def timed(fn, reps: int, *args) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def encode_fresh(ours: BpeTokenizer, texts: list[str]) -> list[list[int]]:
    ours.forget_words()  # as a new client: no word seen yet
    return [ours.encode(t, add_special_tokens=False) for t in texts]


def encode_library(library: tokenizers.Tokenizer, texts: list[str]) -> list[list[int]]:
    return [library.encode(t, add_special_tokens=False).ids for t in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench-out/tokenizer"))
    args = ap.parse_args()
    prompts = [p.text for p in specbench.load()]
    document = "\n\n".join(prompts)
    results = {}
    for model in args.models.split(","):
        served = TokenizerBundle.of_transformers(AutoTokenizer.from_pretrained(resolve_model_dir(model)))
        text = served.tokenizer_json.decode()
        ours = BpeTokenizer.from_json(text)
        library = tokenizers.Tokenizer.from_str(text)
        with tempfile.TemporaryDirectory() as tmp:
            ours.save(Path(tmp))
            row = {
                "load_json_s": {"ours": timed(BpeTokenizer.from_json, args.reps, text),
                                "library": timed(tokenizers.Tokenizer.from_str, args.reps, text)},
                "load_compiled_s": {"ours": timed(BpeTokenizer.load, args.reps, Path(tmp))},
            }
        for name, texts in (("prompts", prompts), ("document", [document])):
            row[f"encode_{name}_s"] = {"ours": timed(encode_fresh, args.reps, ours, texts),
                                       "library": timed(encode_library, args.reps, library, texts)}
        row["tokens"] = len(library.encode(document, add_special_tokens=False).ids)
        row["chars"] = len(document)
        row["ids_equal"] = all(ours.encode(t) == library.encode(t).ids for t in prompts + [document])
        results[model] = row
        print(model, json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
