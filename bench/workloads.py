"""The prompts `specedge bench` measures on: Spec-Bench categories, a prompts file, or many prompts sharing
one long document."""

from __future__ import annotations

import argparse
import json

from specedge.bench import specbench
from specedge.bench.specbench import Prompt


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of `--workload` or `--prompts`."""
    if (args.workload is None) == (args.prompts is None):
        raise ValueError("give exactly one of --workload specbench:CAT,... and --prompts FILE.jsonl")
    if args.prompts is not None:
        prompts = []
        for n, line in enumerate(args.prompts.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            text = rec.get("prompt") or (rec.get("turns") or [None])[0]
            if not isinstance(text, str):
                raise ValueError(f"{args.prompts}:{n}: no 'prompt' (or Spec-Bench 'turns')")
            prompts.append(Prompt(str(rec.get("id", rec.get("question_id", n))), rec.get("category", "all"), text))
        return prompts
    kind, _, cats = args.workload.partition(":")
    if kind == "shared-doc":
        return shared_document_prompts(int(cats or 16))
    if kind != "specbench" or not cats:
        raise ValueError(f"--workload must look like specbench:CAT,...; got {args.workload!r}")
    wanted = None if cats == "all" else cats.split(",")
    chosen = []
    pool = specbench.load(categories=wanted)
    for cat in dict.fromkeys(p.category for p in pool):
        chosen += [p for p in pool if p.category == cat][: args.per_category]
    return chosen


def shared_document_prompts(n: int) -> list[Prompt]:
    """n prompts that begin with the same ~1,400-token document (two Spec-Bench articles) and then ask
    different things about it: the case where a verifier's prefix cache stores the document once."""
    articles = [p.text.removeprefix("Summarize: ") for p in specbench.load(categories=["summarization"])[:2]]
    document = "Document:\n" + "\n\n".join(articles)
    asks = ["Summarize the document in one sentence.", "Who are the people in the document?",
            "Where do the events take place?", "Give the document a title.", "What happened first?",
            "What happened last?", "List three facts from the document.", "What is the main topic?"]
    return [Prompt(f"shared-{i}", "shared-doc", f"{document}\n\nTask {i + 1}: {asks[i % len(asks)]}") for i in range(n)]


def document_conversations(documents: int, clients: int) -> list[tuple[str, list[str]]]:
    """Per client, (a document, the questions it asks about it in turn): `documents` documents of ~1,400
    tokens (two Spec-Bench articles each), client c on document c % documents. Later turns repeat the
    whole conversation so far, so a verifier that saw the earlier turn holds most of the prompt."""
    articles = [p.text.removeprefix("Summarize: ") for p in specbench.load(categories=["summarization"])]
    if len(articles) < 2 * documents:
        raise ValueError(f"{documents} documents need {2 * documents} articles; Spec-Bench has {len(articles)}")
    docs = ["Document:\n" + "\n\n".join(articles[2 * d : 2 * d + 2]) for d in range(documents)]
    asks = ["Summarize the document in one sentence.", "Who are the people in the document?",
            "Where do the events take place?", "Give the document a title.", "What happened first?",
            "What happened last?", "List three facts from the document.", "What is the main topic?"]
    return [(docs[c % documents], [asks[(c + t) % len(asks)] for t in range(len(asks))]) for c in range(clients)]
