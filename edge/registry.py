"""Drafters by name, as the command line and the benchmark name them."""

from __future__ import annotations

from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.datastore import Datastore
from specedge.edge.drafter import Drafter
from specedge.edge.retrieval import RetrievalDrafter

DRAFTERS = ("none", "retrieval")


def make_drafter(name: str, datastore: Datastore | None = None, max_nodes: int = MAX_TREE_NODES) -> Drafter | None:
    """None for plain decoding."""
    if name == "none":
        if datastore is not None:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")
        return None
    if name == "retrieval":
        return RetrievalDrafter(datastore=datastore, max_nodes=max_nodes)
    if name == "hybrid" or name.startswith("model:"):
        raise ValueError(f"drafter {name!r} is not available yet; available: {', '.join(DRAFTERS)}")
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(DRAFTERS)}")
