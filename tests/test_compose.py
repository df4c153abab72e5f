"""docker-compose.yml without a Docker engine: every service's command runs as a local process, service
names mapped to loopback ports from the same file, started in the order of its `depends_on` (waiting on
each health check it names, run as written), and the edge service's `specedge bench` runs to completion
through proxy, router and both verifiers. The test reads the file itself, so the two cannot drift."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from specedge.common.ports import free_port

ROOT = Path(__file__).parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
INTERPOLATION = re.compile(r"\$\{(\w+):-([^}]*)\}")


def test_the_file_wires_the_cluster_as_documented():
    assert set(SERVICES) == {"router", "verifier-1", "verifier-2", "proxy", "edge"}
    for name in ("verifier-1", "verifier-2"):
        command = SERVICES[name]["command"]
        assert command[:2] == ["specedge", "serve"] and command[command.index("--register") + 1] == "router:50050"
        assert command[command.index("--threads") + 1] == "${VERIFIER_THREADS:-1}"  # two on one host: a share each
        assert SERVICES[name]["depends_on"]["router"]["condition"] == "service_healthy"
        check = SERVICES[name]["healthcheck"]
        assert check["test"][1:3] == ["specedge", "health"] and "start_period" in check and "interval" in check
    assert "models:/var/cache/specedge" in SERVICES["router"]["volumes"] and "models" in COMPOSE["volumes"]
    edge = SERVICES["edge"]["command"]
    assert edge[:2] == ["specedge", "bench"] and edge[edge.index("--server") + 1] == "proxy:50060"
    assert SERVICES["proxy"]["command"][SERVICES["proxy"]["command"].index("--upstream") + 1] == "router:50050"
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    for name in ("verifier-1", "verifier-2"):
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert (ROOT / gpu[name]["build"]["dockerfile"]).exists()


class LocalCompose:
    """The compose file's services as local processes."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.ports = {(name, int(p)): free_port() for name, s in SERVICES.items() for p in s.get("expose", [])}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def localize(self, service: str, argv: list[str]) -> list[str]:
        """A container's command as a local one: variables filled in as compose does (`${NAME:-default}`),
        the specedge of this venv, loopback addresses and ports."""
        out = []
        argv = [INTERPOLATION.sub(lambda m: os.environ.get(m[1]) or m[2], arg) for arg in argv]
        for prev, arg in zip([None] + argv, argv):
            if prev is None and arg == "specedge":
                arg = str(Path(sys.executable).with_name("specedge"))
            elif prev == "--host" and arg == "0.0.0.0":
                arg = "127.0.0.1"
            elif prev in ("--port", "--metrics-port"):
                arg = str(self.ports[(service, int(arg))])
            elif m := re.fullmatch(r"([\w.-]+):(\d+)", arg):
                host, port = m.group(1), int(m.group(2))
                owner = service if host in ("0.0.0.0", "127.0.0.1") else host
                if (owner, port) in self.ports:
                    arg = f"127.0.0.1:{self.ports[(owner, port)]}"
            elif arg.startswith("/results"):
                arg = str(self.results / arg[len("/results"):].lstrip("/"))
            out.append(arg)
        return out

    def up(self, service: str) -> None:
        """Start `service` after its dependencies, as `docker compose up` orders them."""
        if service in self.procs:
            return
        for dependency, rule in SERVICES[service].get("depends_on", {}).items():
            self.up(dependency)
            if rule["condition"] == "service_healthy":
                self.wait_healthy(dependency)
        self.logs[service] = self.results.parent / f"{service}.log"
        self.procs[service] = subprocess.Popen(self.localize(service, SERVICES[service]["command"]),
                                               stdout=self.logs[service].open("w"), stderr=subprocess.STDOUT)

    def wait_healthy(self, service: str) -> None:
        check = SERVICES[service]["healthcheck"]
        command = self.localize(service, check["test"][1:])  # after "CMD"
        deadline = time.monotonic() + _seconds(check["start_period"]) + 60
        while subprocess.run(command, capture_output=True).returncode != 0:
            assert self.procs[service].poll() is None, f"{service} exited:\n{self.logs[service].read_text()}"
            assert time.monotonic() < deadline, f"{service} never became healthy:\n{self.logs[service].read_text()}"
            time.sleep(_seconds(check["interval"]) / 4)

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _seconds(duration: str) -> float:
    return float(duration.rstrip("s"))


@pytest.mark.real_model
def test_the_edge_service_runs_its_experiment_through_proxy_router_and_verifiers():
    with tempfile.TemporaryDirectory() as tmp:
        compose = LocalCompose(Path(tmp) / "results")
        try:
            compose.up("edge")
            edge = compose.procs["edge"]
            assert edge.wait(timeout=600) == 0, compose.logs["edge"].read_text()
            rows = json.loads((Path(tmp) / "results" / "results.json").read_text())["rows"]
            assert {row["method"] for row in rows} == {"server-ar", "retrieval"}
            for name in ("verifier-1", "verifier-2", "router", "proxy"):
                assert compose.procs[name].poll() is None, f"{name} died:\n{compose.logs[name].read_text()}"
            router_log = compose.logs["router"].read_text()
            assert router_log.count('"event": "verifier_added"') == 2  # both registered
        finally:
            compose.down()
