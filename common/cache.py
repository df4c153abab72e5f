"""Where specedge keeps what it builds once: converted models, datastores, tokenizers fetched from verifiers."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """$SPECEDGE_CACHE, else the user's cache directory (e.g. ~/.cache/specedge)."""
    return Path(os.environ.get("SPECEDGE_CACHE") or platformdirs.user_cache_dir("specedge"))
