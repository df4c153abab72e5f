"""Where specedge keeps what it builds once: converted models, datastores, tokenizers fetched from verifiers."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """$SPECEDGE_CACHE, else the user's cache directory (e.g. ~/.cache/specedge)."""
    return Path(os.environ.get("SPECEDGE_CACHE") or platformdirs.user_cache_dir("specedge"))


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time (an exclusive lock on `lock_path`, created if missing): for building a
    cache entry that several processes may want at once, e.g. a cluster's services started together on a
    fresh machine."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed, also if the process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
