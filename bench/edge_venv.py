"""A fresh virtual environment with nothing but `specedge[edge]` in it: how a phone-sized client installs
specedge. Used by tests/test_edge_install.py and bench/edge_startup.py.

The wheel is built from this checkout by the full venv's pip (it has the stub generator, grpcio-tools);
the new venv then installs it with its dependencies from the package index, like any user would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a fresh client should be doing in its process: run in the edge venv by the test and the benchmark.
CLIENT_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from specedge.edge.client import EdgeClient
imported = time.perf_counter()
client = EdgeClient(sys.argv[1], drafter="retrieval")
connected = time.perf_counter()
result = client.generate(sys.argv[2], max_new_tokens=int(sys.argv[3]), chat=client.tokenizer.chat_template is not None)
done = time.perf_counter()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m.startswith("specedge.cloud"))
rss_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"token_ids": result.token_ids, "text": result.text, "heavy_modules": heavy,
                  "import_s": imported - t0, "connect_and_tokenizer_s": connected - imported,
                  "ttft_s": result.stats.ttft_s, "generate_s": done - connected, "peak_rss_mb": rss_kb / 1024}))
"""


def build_edge_venv(where: Path, log=print) -> Path:
    """Create a venv under `where` with only specedge[edge] installed; returns its python."""
    wheels = where / "wheels"
    log("building the specedge wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
         str(wheels), str(ROOT))
    venv = where / "edge-venv"
    _run(sys.executable, "-m", "venv", str(venv))
    python = venv / "bin" / "python"
    wheel = next(wheels.glob("specedge-*.whl"))
    log("installing specedge[edge] into a fresh venv")
    _run(str(python), "-m", "pip", "install", "--quiet", f"{wheel}[edge]")
    return python


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def installed_packages(python: Path) -> dict[str, int]:
    """Bytes on disk per installed distribution of that venv, pip and setuptools (any venv's) left out."""
    code = ("import importlib.metadata as m, json, os\n"
            "sizes = {}\n"
            "for d in m.distributions():\n"
            "    files = [f.locate() for f in (d.files or [])]\n"
            "    sizes[d.metadata['Name']] = sum(os.path.getsize(f) for f in files if os.path.isfile(f))\n"
            "print(json.dumps(sizes))")
    import json

    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return {name: size for name, size in json.loads(out).items() if name not in ("pip", "setuptools")}
