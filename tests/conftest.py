from __future__ import annotations

import os
import sys

import pytest

from specedge.common.ports import RANGE_ENV, port_range


def _share_the_machine_between_workers() -> None:
    """Under pytest-xdist (`make test` runs two workers, one a core): each worker gets its own share of the
    ports free_port hands out, so that a port one worker has chosen and not yet bound (or freed to restart a
    server on it) is never chosen by another; and its share of the cores for torch's threads, here and in the
    processes it starts (two threads a worker on two cores ran the suite in 26 min, one in 19)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return
    index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    first, last = port_range()
    share = (last - first + 1) // count
    os.environ[RANGE_ENV] = f"{first + index * share}-{first + (index + 1) * share - 1}"
    threads = str(max(1, len(os.sched_getaffinity(0)) // count))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    if "torch" in sys.modules:  # already loaded: its pool was sized before the variable was set
        sys.modules["torch"].set_num_threads(int(threads))


_share_the_machine_between_workers()


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
