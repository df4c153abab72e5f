"""Generates the gRPC stubs from protos/ into protos/gen (the package `specedge.protos`) whenever the
package is built or installed, editable installs included; configuration lives in pyproject.toml."""

import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    protos = sorted((ROOT / "protos").rglob("*.proto"))
    out = ROOT / "protos" / "gen"
    stamp = out / ".stamp"
    newest = max(p.stat().st_mtime for p in protos)
    if stamp.exists() and stamp.stat().st_mtime >= newest:
        return
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{Path(protoc.__file__).parent / '_proto'}",
                f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *map(str, protos)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(map(str, protos)))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in Path(tmp).rglob("*.py*"):
            # The stubs import each other as `specedge.v1`; here they live in `specedge.protos`.
            text = re.sub(r"^from specedge\.v1 import", "from specedge.protos import", f.read_text(), flags=re.M)
            (out / f.name).write_text(text)
    (out / "__init__.py").write_text('"""Generated from protos/specedge/v1 by setup.py: do not edit."""\n')
    stamp.touch()


generate_stubs()
setup()
