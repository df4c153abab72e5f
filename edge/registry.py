"""Drafters by name, as the command line and the benchmark name them:
`none`, `retrieval` (with the verifier's hints when it offers them; `retrieval:no-hints` without),
`model:NAME` (a drafting model, edge/draft_models.py), `hybrid[:NAME]` (both in one tree; the model
defaults to smollm2-135m)."""

from __future__ import annotations

from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.datastore import Datastore
from specedge.edge.drafter import Drafter
from specedge.edge.retrieval import RetrievalDrafter

DRAFTERS = ("none", "retrieval", "retrieval:no-hints", "model:NAME", "hybrid[:NAME]")
DEFAULT_DRAFT_MODEL = "smollm2-135m"


def make_drafter(name: str, datastore: Datastore | None = None, max_nodes: int = MAX_TREE_NODES,
                 tokenizer=None, eos_ids: list[int] = ()) -> Drafter | None:
    """None for plain decoding. A model drafter needs the target's `tokenizer` (an EdgeTokenizer) and
    end-of-generation ids, to tell whether the vocabularies differ."""
    if name == "none":
        if datastore is not None:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")
        return None
    if name in ("retrieval", "retrieval:no-hints"):
        hints = {} if name == "retrieval" else {"hints_top_k": 0}
        return RetrievalDrafter(datastore=datastore, max_nodes=max_nodes, **hints)
    model_name = drafting_model(name)
    if model_name is not None and name.startswith("model:"):
        if datastore is not None:
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval or hybrid")
        return _model_drafter(model_name, max_nodes, tokenizer, eos_ids)
    if model_name is not None:
        from specedge.edge.hybrid import HybridDrafter

        model = _model_drafter(model_name, max_nodes, tokenizer, eos_ids)
        return HybridDrafter(RetrievalDrafter(datastore=datastore, max_nodes=max_nodes), model, max_nodes)
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(DRAFTERS)}")


def drafting_model(name: str) -> str | None:
    """The drafting model a drafter name asks for (model:NAME, hybrid, hybrid:NAME), None for the others."""
    kind, _, model = name.partition(":")
    if kind == "model" and model:
        return model
    if kind == "hybrid":
        return model or DEFAULT_DRAFT_MODEL
    return None


def check_drafter(name: str, corpus: bool = False) -> None:
    """Raise ValueError for a drafter that cannot work here, before anything slow is loaded."""
    model = drafting_model(name)
    if model is not None:
        from specedge.edge.draft_model import llama_cpp_module
        from specedge.edge.draft_models import draft_model_path

        try:
            llama_cpp_module()
        except ImportError as e:
            raise ValueError(str(e)) from e
        draft_model_path(model)
        if corpus and name.startswith("model:"):
            raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval or hybrid")
        return
    if make_drafter(name) is None and corpus:
        raise ValueError("--corpus needs a drafter that uses it: --drafter retrieval")


# (GGUF path, target tokenizer fingerprint, its chat template) -> a vocabulary bridge to copy: building one reads both
# vocabularies (~0.5 s), and a client makes a drafter per concurrent generation.
_BRIDGES: dict[tuple[str, str, str | None], object] = {}


def _model_drafter(model_name: str, max_nodes: int, tokenizer, eos_ids: list[int]) -> Drafter:
    import copy

    from specedge.edge.draft_model import DraftModel
    from specedge.edge.draft_models import draft_model_path
    from specedge.edge.model_drafter import ModelDrafter
    from specedge.edge.vocab_bridge import bridge_between

    if tokenizer is None:
        raise ValueError("a model drafter needs the target's tokenizer")
    model = DraftModel(draft_model_path(model_name))
    key = (str(model.path), tokenizer.fingerprint, tokenizer.chat_template)  # the bridge renders chats with it
    if key not in _BRIDGES:
        backend = tokenizer.backend
        _BRIDGES[key] = bridge_between(model, backend, {t: backend.id_to_token(t) for t in eos_ids},
                                       tokenizer.render_chat if tokenizer.chat_template else None)
        if _BRIDGES[key].cross:
            _BRIDGES[key].tokenize = None  # each copy tokenises with its own model; this one may go
    bridge = copy.copy(_BRIDGES[key])  # begin() gives it its own state; the tables are shared, read-only
    if bridge.cross:
        bridge.tokenize = model.tokenize
    return ModelDrafter(model, bridge, max_nodes=max_nodes)
