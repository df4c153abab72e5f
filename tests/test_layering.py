"""The layering the design promises: `common/` holds only what both sides use and needs no torch; the edge
uses `common/` and never the verifier (`cloud/`), torch or transformers, so a phone-sized client can
install it alone (test_edge_install.py installs it in a bare venv). The router and the network proxy run
without the model's stack either: they need no torch, transformers or engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "gguf", "accelerate", "prometheus_client", "matplotlib")
NOT_ON_THE_EDGE = ("tokenizers", "pydivsufsort")  # the edge install leaves them out (edge/bpe_tokenizer.py)


def imports_of(package: str) -> dict[str, set[str]]:
    """Module file -> every module it imports, at any depth of its code (lazy imports included)."""
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[f"{package}/{path.name}"] = names
    return found


def offending(imports: dict[str, set[str]], banned: tuple[str, ...]) -> list[str]:
    return [f"{f} imports {m}" for f, names in imports.items() for m in sorted(names)
            if any(m == b or m.startswith(b + ".") for b in banned)]


@pytest.mark.parametrize("package, banned", [
    ("common", ("specedge.cloud", "specedge.edge", "specedge.cli", "specedge.bench", *HEAVY, *NOT_ON_THE_EDGE)),
    ("edge", ("specedge.cloud", "specedge.cli", "specedge.bench", *HEAVY, *NOT_ON_THE_EDGE)),
    ("cloud/router", ("specedge.edge", "specedge.cli", "specedge.bench", "specedge.cloud.engine",
                      "specedge.cloud.kv_pool", "specedge.cloud.service", "specedge.cloud.server",
                      *HEAVY[:-2])),
    ("netem", ("specedge.cloud", "specedge.edge", "specedge.cli", "specedge.bench", *HEAVY)),
])
def test_no_module_reaches_across_the_layers(package, banned):
    assert offending(imports_of(package), banned) == []


def test_the_client_sdk_loads_without_torch_transformers_or_the_verifier():
    code = ("import sys, specedge.edge.client, specedge.edge.corpus, specedge.edge.registry;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in %r or m.startswith('specedge.cloud')))"
            % (HEAVY + NOT_ON_THE_EDGE,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_router_loads_without_torch():
    code = "import sys, specedge.cloud.router.server; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
