"""Drafters by name, as the command line and the benchmark name them:
`none`, `retrieval`, `model:NAME` (a drafting model, edge/draft_models.py)."""

from __future__ import annotations

from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.datastore import Datastore
from specedge.edge.drafter import Drafter
from specedge.edge.retrieval import RetrievalDrafter

DRAFTERS = ("none", "retrieval", "model:NAME")


def make_drafter(name: str, datastore: Datastore | None = None, max_nodes: int = MAX_TREE_NODES,
                 tokenizer=None, eos_ids: list[int] = ()) -> Drafter | None:
    """None for plain decoding. A model drafter needs the target's `tokenizer` (an EdgeTokenizer) and
    end-of-generation ids, to tell whether the vocabularies differ."""
    if name == "none":
        if datastore is not None:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")
        return None
    if name == "retrieval":
        return RetrievalDrafter(datastore=datastore, max_nodes=max_nodes)
    if name.startswith("model:"):
        if datastore is not None:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")
        return _model_drafter(name.removeprefix("model:"), max_nodes, tokenizer, eos_ids)
    if name == "hybrid" or name.startswith("hybrid:"):
        raise ValueError(f"drafter {name!r} is not available yet; available: {', '.join(DRAFTERS)}")
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(DRAFTERS)}")


def check_drafter(name: str, corpus: bool = False) -> None:
    """Raise ValueError for a drafter that cannot work here, before anything slow is loaded."""
    if name.startswith("model:"):
        from specedge.edge.draft_model import llama_cpp_module
        from specedge.edge.draft_models import draft_model_path

        try:
            llama_cpp_module()
        except ImportError as e:
            raise ValueError(str(e)) from e
        draft_model_path(name.removeprefix("model:"))
        if corpus:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")
        return
    if make_drafter(name) is None and corpus:
        raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")


def _model_drafter(model_name: str, max_nodes: int, tokenizer, eos_ids: list[int]) -> Drafter:
    from specedge.edge.draft_model import DraftModel
    from specedge.edge.draft_models import draft_model_path
    from specedge.edge.model_drafter import ModelDrafter
    from specedge.edge.vocab_bridge import bridge_between

    if tokenizer is None:
        raise ValueError("a model drafter needs the target's tokenizer")
    model = DraftModel(draft_model_path(model_name))
    backend = tokenizer.backend
    ends = {t: backend.id_to_token(t) for t in eos_ids}
    return ModelDrafter(model, bridge_between(model, backend, ends), max_nodes=max_nodes)
