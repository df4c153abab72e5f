"""Spec-Bench prompts (../shared/data/spec_bench/question.jsonl): lines with question_id, category, turns."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def default_path() -> Path:
    return Path(os.environ.get("SPECEDGE_SPEC_BENCH") or _REPO.parent / "shared/data/spec_bench/question.jsonl")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first turn


def load(path: Path | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """All prompts of the file (in file order), optionally only those of `categories`."""
    path = path or default_path()
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; set SPECEDGE_SPEC_BENCH")
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                prompts.append(Prompt(str(q["question_id"]), q["category"], q["turns"][0]))
    if categories is not None:
        unknown = set(categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(f"unknown Spec-Bench categories {sorted(unknown)}")
        prompts = [p for p in prompts if p.category in categories]
    return prompts


def stratified(prompts: list[Prompt], n: int) -> list[Prompt]:
    """`n` prompts taken round-robin over the categories (sorted), first questions first."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    rounds = zip_longest(*(by_category[c] for c in sorted(by_category)))
    return [p for r in rounds for p in r if p is not None][:n]
