"""Verifiers' tokenizers kept on this device, one directory per fingerprint, so that a client starts without
fetching one. An entry holds the tokenizer.json as served and its compiled form (what a client loads:
~0.2 s for Gemma 3's 262k-token vocabulary against ~1.2 s from the JSON). It is written to a temporary
directory, gets a digest of its files written last, and is renamed into place; an entry whose files no
longer match its digest (damaged, edited, or from an older specedge) is fetched again.

The fingerprint is checked once, when a tokenizer is fetched; a loaded entry's fingerprint is its name.
Recomputing it at every start would cost ~0.5 s and ~60 MB at peak for Gemma 3, the digest ~0.05 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from specedge.common.cache import cache_root
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.edge.bpe_tokenizer import BpeTokenizer
from specedge.edge.tokenizer import EdgeTokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "specedge-tokenizer.json"
COMPILED_DIR = "compiled"
DIGEST_FILE = "sha256"


def verifier_tokenizer(verifier) -> EdgeTokenizer:
    """A verifier's tokenizer (an edge/transport.py RemoteVerifier): from this device's cache, else fetched
    from the verifier, checked against the fingerprint it advertises, and cached."""
    fingerprint = verifier.info.tokenizer_fingerprint
    entry = cache_root() / "tokenizers" / fingerprint
    tokenizer = _load(entry)
    if tokenizer is not None:
        return tokenizer
    bundle = verifier.tokenizer(fingerprint)
    tokenizer = EdgeTokenizer.from_bundle(bundle)
    if tokenizer.fingerprint != fingerprint:
        raise ValueError(f"the verifier sent a tokenizer ({tokenizer.fingerprint}) that is not the one it "
                         f"advertises ({fingerprint})")
    _save(bundle, tokenizer.backend, entry)
    return tokenizer


def _load(entry: Path) -> EdgeTokenizer | None:
    if not entry.is_dir():
        return None
    try:
        if (entry / DIGEST_FILE).read_text() == _digest(entry):
            config = json.loads((entry / CONFIG_FILE).read_text())
            return EdgeTokenizer(BpeTokenizer.load(entry / COMPILED_DIR), config["chat_template"],
                                 config["special_tokens"], config["clean_up_spaces"], fingerprint=entry.name)
    except (OSError, ValueError, KeyError, EOFError, TypeError):  # unreadable, incomplete or of another format
        pass
    shutil.rmtree(entry, ignore_errors=True)  # damaged or edited: fetch it anew
    return None


def _save(bundle: TokenizerBundle, compiled: BpeTokenizer, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        (tmp / TOKENIZER_FILE).write_bytes(bundle.tokenizer_json)
        (tmp / CONFIG_FILE).write_text(json.dumps({"chat_template": bundle.chat_template,
                                                   "special_tokens": bundle.special_tokens,
                                                   "clean_up_spaces": bundle.clean_up_spaces}, indent=1))
        (tmp / COMPILED_DIR).mkdir()
        compiled.save(tmp / COMPILED_DIR)
        (tmp / DIGEST_FILE).write_text(_digest(tmp))
        os.rename(tmp, entry)  # atomic: the entry appears complete or not at all
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.is_dir():  # not merely another client that got there first
            raise


def _digest(entry: Path) -> str:
    """Of every file of the entry but the digest, names included."""
    h = hashlib.sha256()
    for path in sorted(p for p in entry.rglob("*") if p.is_file() and p.name != DIGEST_FILE):
        h.update(str(path.relative_to(entry)).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()
