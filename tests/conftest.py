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


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA, and certificates it signed for 127.0.0.1/localhost named server, client and router (each usable
    to serve and to present as a client), made with openssl: `certs / "server.pem"`, `"server.key"`, ..."""
    from specedge.bench.certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"))
