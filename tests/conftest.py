from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_model():
    """Load a registry model once per test session: real_model(name) -> (hf_model, tokenizer)."""
    from specedge.cloud.model_registry import load_model

    loaded: dict[str, tuple] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        return loaded[name]

    return get
