"""Starting a verifier: from a model name to a serving gRPC server, in the foreground (`specedge serve`),
on a background thread of this process (the embedded verifier of `specedge generate` and tests), or as
a child process (benchmarks of serving)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import grpc
import torch

from specedge.cloud.config import ServerConfig
from specedge.cloud.device import compile_layers, engine_device
from specedge.cloud.engine import Engine
from specedge.cloud.model_registry import eos_token_ids, load_model
from specedge.cloud.server import RunningServer, start_server
from specedge.cloud.service import ServedModel
from specedge.common.ports import free_port
from specedge.common.tokenizer_bundle import TokenizerBundle, tokenizer_fingerprint

T = TypeVar("T")

FAILED_GRACE_S = 2.0  # a verifier whose scheduler failed: time for its sessions' errors to reach them


def load_served_model(config: ServerConfig, hf_and_tokenizer=None) -> ServedModel:
    """The model of `config` (or the given transformers model and tokenizer) ready to serve. A tokenizer of
    None serves token ids only (tests with tiny random models)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device, dtype = engine_device(config.device, config.dtype)  # a wrong flag fails before the model loads
    compiled = compile_layers(config.compile, device)
    hf, tokenizer = hf_and_tokenizer or load_model(config.model)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=config.kv_pool_mb << 20, device=device, dtype=dtype,
                                  compile_layers=compiled)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    int8_argmax = engine.runner.lm_head.prepare()  # not in the first greedy request's time
    logging.getLogger("specedge.server").info(json.dumps({"event": "engine", "device": where,
                                                          "dtype": str(dtype).removeprefix("torch."),
                                                          "compiled": engine.compiled, "int8_argmax": int8_argmax}))
    if tokenizer is None:
        return ServedModel(engine, eos_token_ids(hf), "no-tokenizer")
    fingerprint = tokenizer_fingerprint(tokenizer.get_vocab(), tokenizer.special_tokens_map)
    return ServedModel(engine, eos_token_ids(hf), fingerprint, TokenizerBundle.of_transformers(tokenizer))


def serve_forever(config: ServerConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain open sessions for up to `config.grace_s` and stop; exit
    with an error if the verify scheduler fails (cloud/scheduler.py). Engine
    steps run on this thread, which loaded the model (see VerifyScheduler); gRPC runs on an event loop thread."""
    model = load_served_model(config)
    grace_s = config.grace_s
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    def serve_grpc() -> None:
        asyncio.set_event_loop(loop)
        try:
            started["server"] = loop.run_until_complete(
                start_server(model, config, scheduler_thread=False))
        except BaseException as e:  # re-raised on the main thread
            started["error"] = e
        ready.set()
        if "server" in started:
            loop.run_forever()

    grpc_thread = threading.Thread(target=serve_grpc, name="grpc", daemon=True)
    grpc_thread.start()
    ready.wait()
    if "error" in started:
        raise started["error"]
    running: RunningServer = started["server"]
    stopping: list = []

    def on_signal(signum, frame) -> None:
        if not stopping:  # drains, then stops the scheduler, which ends run() below
            stopping.append(asyncio.run_coroutine_threadsafe(running.stop(grace_s), loop))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    scheduler = running.service.scheduler
    scheduler.run()
    if scheduler.failure is not None and not stopping:  # its clients were told; let them hear it, then exit
        stopping.append(asyncio.run_coroutine_threadsafe(running.stop(FAILED_GRACE_S), loop))
    if stopping:
        stopping[0].result(timeout=grace_s + 30)
    loop.call_soon_threadsafe(loop.stop)
    grpc_thread.join(timeout=10)
    if scheduler.failure is not None:  # a supervisor (compose's restart policy, Ray) starts a fresh one
        raise SystemExit(f"specedge serve: the verify scheduler failed: {scheduler.failure!r}"[:300])


class EmbeddedVerifier:
    """A real gRPC verifier on loopback, served from a background thread of this process."""

    def __init__(self, config: ServerConfig, hf_and_tokenizer=None, scheduler_thread: bool = True) -> None:
        """With `scheduler_thread=False` engine steps run only inside `run_engine_while`, on its caller's
        thread (faster when that thread loaded the model; see VerifyScheduler)."""
        config = replace(config, port=config.port or 0)
        model = load_served_model(config, hf_and_tokenizer)
        self.engine = model.engine
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.running: RunningServer | None = None
        self._error: BaseException | None = None

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self.running = self._loop.run_until_complete(
                    start_server(model, config, scheduler_thread))
            except BaseException as e:  # reported to the constructor's caller
                self._error = e
                self._started.set()
                return
            self._started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="embedded-verifier", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        self.port = self.running.port
        self.target = f"127.0.0.1:{self.port}"

    @property
    def service(self):
        return self.running.service

    def run_engine_while(self, work: Callable[[], T]) -> T:
        """Call `work` on a new thread while this thread runs engine steps; its result once it returns.
        The verifier then stops taking work (for `scheduler_thread=False`: one job, e.g. the CLI's)."""
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = work()
            except BaseException as e:  # re-raised on the calling thread
                box["error"] = e
            finally:
                self.service.scheduler.stop()

        worker = threading.Thread(target=run, name="embedded-client", daemon=True)
        worker.start()
        self.service.scheduler.run()
        worker.join()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def used_blocks(self, want: int = 0, wait_s: float = 10.0) -> int:
        """The KV pool's used blocks, after waiting up to `wait_s` for them to drop to `want`. A client's
        call returns on its last reply; the server releases that session's blocks a moment later."""
        deadline = time.monotonic() + wait_s
        while (used := self.engine.pool.stats().used) > want and time.monotonic() < deadline:
            time.sleep(0.05)
        return used

    def kill(self) -> None:
        """Stop answering at once, with no drain and no goodbye to a router: as near to SIGKILL as a server in
        this process gets (its clients' streams break)."""

        async def die() -> None:
            if self.running.registration is not None:
                self.running.registration.cancel()
            await self.running.server.stop(None)

        asyncio.run_coroutine_threadsafe(die(), self._loop).result(timeout=30)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.running is None:
            return
        asyncio.run_coroutine_threadsafe(self.running.stop(grace_s), self._loop).result(timeout=grace_s + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.running = None

    def __enter__(self) -> EmbeddedVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ServiceProcess:
    """A `specedge` service (`serve`, `router`) as a child process on loopback ports, as it runs in a
    deployment: its own interpreter and GIL, apart from the clients. For benchmarks and tests."""

    def __init__(self, command: str, *args: str, port: int | None = None, startup_s: float = 300.0,
                 cpus: set[int] | None = None) -> None:
        self.cpus = cpus  # the cores it may run on (benchmarks pin it); None: any
        self.port, self.metrics_port = port or free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._argv = [sys.executable, "-m", "specedge.cli", command, "--host", "127.0.0.1", "--port", str(self.port),
                      "--metrics-port", str(self.metrics_port), *args]
        self._log = tempfile.TemporaryFile(mode="w+")
        self.start(startup_s)

    def start(self, startup_s: float = 300.0) -> None:
        """(Re)start the process on the same ports and wait until it serves."""
        pin = None if self.cpus is None else lambda: os.sched_setaffinity(0, self.cpus)
        self._proc = subprocess.Popen(self._argv, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=pin)
        try:
            self._wait_serving(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, startup_s: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self._argv[3]} exited with {self._proc.returncode}:\n{self.output()}")
            with grpc.insecure_channel(self.target) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"{self._argv[3]} did not start serving within {startup_s:.0f} s:\n{self.output()}")

    def metric(self, name: str) -> float:
        """The value of an unlabelled Prometheus metric of the process."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(f"{self._argv[3]} has no metric {name}")

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        self._proc.kill()
        self._proc.wait()

    def stop(self, grace_s: float = 30.0) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: drain, then exit
            try:
                self._proc.wait(grace_s + 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


class VerifierProcess(ServiceProcess):
    """`specedge serve` as a child process."""

    def __init__(self, *serve_args: str, startup_s: float = 300.0, cpus: set[int] | None = None) -> None:
        super().__init__("serve", *serve_args, startup_s=startup_s, cpus=cpus)
