"""Documents for the long-term datastore: read from files, tokenised, built into a datastore on disk."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from specedge.common.cache import cache_root, locked
from specedge.edge import datastore
from specedge.edge.tokenizer import EdgeTokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".tex", ""}
JSONL_FIELDS = ("text", "output", "document", "content", "prompt")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def corpus_files(paths: list[Path]) -> list[Path]:
    """The files named, and the text files under the directories named, in a stable order."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path {p} does not exist")
    if not files:
        raise ValueError(f"no text files found in {', '.join(map(str, paths))}")
    return files


def read_documents(files: list[Path]) -> Iterator[tuple[str, str]]:
    """(source, text) per document: a whole file, or each line of a .jsonl file (its first text field,
    or the turns of a Spec-Bench line), so past outputs saved as JSON lines become documents too."""
    for f in files:
        if f.suffix.lower() != ".jsonl":
            yield str(f), f.read_text(errors="replace")
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            text = next((record[k] for k in JSONL_FIELDS if isinstance(record.get(k), str)), None)
            if text is None and isinstance(record.get("turns"), list):
                text = "\n".join(map(str, record["turns"]))
            if text:
                yield f"{f}:{n}", text


def build_datastore(paths: list[Path], tokenizer: EdgeTokenizer, out: Path, log: Callable[[str], None] = _log
                    ) -> dict:
    files = corpus_files(paths)
    log(f"indexing {len(files)} files into {out}")
    sources: list[str] = []

    def documents():
        batch: list[str] = []
        for i, (source, text) in enumerate(read_documents(files), start=1):
            sources.append(source)
            batch.append(text)
            if len(batch) == 256:
                yield from tokenizer.encode_documents(batch)
                batch = []
                log(f"  tokenised {i} documents")
        if batch:
            yield from tokenizer.encode_documents(batch)

    meta = datastore.build(documents(), out, tokenizer.fingerprint, [str(f) for f in files], log)
    log(f"datastore {out}: {meta['num_tokens']:,} tokens, {meta['num_documents']} documents, built in "
        f"{meta['build_s']} s (suffix sort {meta['suffix_sort_s']} s), {meta['bytes_per_token']} bytes/token")
    return meta


def open_corpus(paths: list[Path], tokenizer: EdgeTokenizer, log: Callable[[str], None] = _log
                ) -> datastore.Datastore:
    """A datastore directory as is, or files built (once, cached by content) into a datastore."""
    fingerprint = tokenizer.fingerprint
    if len(paths) == 1 and (Path(paths[0]) / "meta.json").is_file():
        store = datastore.Datastore(paths[0])
    else:
        files = corpus_files(paths)
        h = hashlib.sha256(fingerprint.encode())
        for f in files:
            h.update(str(f.resolve()).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        out = cache_root() / "datastores" / h.hexdigest()[:20]
        with locked(out.with_name(f"{out.name}.lock")):  # two processes never build into one directory
            if not (out / "meta.json").is_file():
                build_datastore(files, tokenizer, out, log)
        store = datastore.Datastore(out)
    if store.tokenizer_fingerprint != fingerprint:
        raise ValueError(f"datastore {store.path} was built with another tokenizer "
                         f"({store.tokenizer_fingerprint}, this model's is {fingerprint}); rebuild it")
    return store
