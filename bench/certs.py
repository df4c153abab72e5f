"""Certificates for trying TLS on loopback (the tests' fixture, bench/round_split.py --tls): a CA, and
certificates it signed for 127.0.0.1/localhost under the given names, each usable to serve and to present as a
client. Made with the `openssl` command; not for a deployment (2-day keys, no passphrase)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certs(directory: Path, names: tuple[str, ...] = ("server", "client", "router")) -> Path:
    """`directory / "ca.pem"`, and for each name `NAME.pem` and `NAME.key`; returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)

    def sh(*args: str) -> None:
        subprocess.run(args, cwd=directory, check=True, capture_output=True)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
       "-keyout", "ca.key", "-out", "ca.pem")
    for name in names:
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
           "-out", f"{name}.csr")
        (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return directory
