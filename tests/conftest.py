from __future__ import annotations

import subprocess

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
    d = tmp_path_factory.mktemp("certs")

    def sh(*args):
        subprocess.run(args, cwd=d, check=True, capture_output=True)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
       "-keyout", "ca.key", "-out", "ca.pem")
    for name in ("server", "client", "router"):
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
           "-out", f"{name}.csr")
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return d
