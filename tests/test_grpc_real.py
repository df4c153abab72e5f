"""End to end on the real default model over gRPC on 127.0.0.1: EdgeClient's greedy output equals
transformers' generate; 16 concurrent clients each get exactly their solo output while sharing engine
steps; one AsyncEdgeClient runs concurrent generations; `specedge serve` and `specedge generate --server`
work as separate processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from specedge.bench import specbench
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.common.ports import free_port
from specedge.edge.client import AsyncEdgeClient, EdgeClient

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def verifier(real_model):
    with EmbeddedVerifier(ServerConfig(model=MODEL, port=0, kv_pool_mb=256), real_model(MODEL)) as v:
        yield v


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


def test_edge_client_greedy_output_equals_transformers_generate(verifier, real_model):
    hf, tokenizer = real_model(MODEL)
    client = EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
    for p in specbench.stratified(specbench.load(categories=["summarization", "qa", "writing"]), 3):
        result = client.generate(p.text, max_new_tokens=40, chat=True)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        assert result.token_ids == hf_greedy(hf, list(ids), 40), p.id
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    client.close()


def test_streamed_text_adds_up_to_the_generated_text(verifier, real_model):
    _, tokenizer = real_model(MODEL)
    client = EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
    pieces = list(client.stream("List three colours.", max_new_tokens=24, chat=True))
    whole = client.generate("List three colours.", max_new_tokens=24, chat=True).text
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_sixteen_concurrent_clients_each_get_their_solo_output(verifier, real_model):
    _, tokenizer = real_model(MODEL)
    prompts = [p.text[:400] for p in specbench.stratified(specbench.load(), 16)]
    solo = []
    for text in prompts:
        solo.append(EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
                    .generate(text, max_new_tokens=16, chat=True).token_ids)
    steps_before = _batch_histogram(verifier)
    results = [None] * 16

    def run(i: int) -> None:
        client = EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
        results[i] = client.generate(prompts[i], max_new_tokens=16, chat=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo
    single, total = (b - a for a, b in zip(steps_before, _batch_histogram(verifier)))
    assert total > single  # steps with more than one session happened
    assert verifier.used_blocks() == 0


def test_async_client_runs_concurrent_generations_each_equal_to_its_solo_output(verifier, real_model):
    _, tokenizer = real_model(MODEL)
    prompts = [p.text[:400] for p in specbench.stratified(specbench.load(categories=["summarization", "rag", "qa"]), 3)]
    client = EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
    solo = [client.generate(text, max_new_tokens=16, chat=True).token_ids for text in prompts]

    async def main():
        shared = AsyncEdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
        results = await asyncio.gather(*(shared.generate(text, max_new_tokens=16, chat=True) for text in prompts))
        pieces = [piece async for piece in shared.stream(prompts[0], max_new_tokens=16, chat=True)]
        await shared.close()
        return results, pieces

    results, pieces = asyncio.run(main())
    assert [r.token_ids for r in results] == solo
    assert len(pieces) > 1 and "".join(pieces) == results[0].text


def _batch_histogram(verifier) -> tuple[float, float]:
    """(engine steps with one session, all engine steps) so far."""
    h = verifier.service.metrics.batch_sessions
    samples = {s.labels["le"]: s.value for m in h.collect() for s in m.samples if s.name.endswith("_bucket")}
    return samples["1.0"], samples["+Inf"]



def dockerfile_command() -> list[str]:
    """The verifier command of deploy/Dockerfile (its CMD), to run here without a Docker engine."""
    line = next(l for l in (Path(__file__).parents[1] / "deploy" / "Dockerfile").read_text().splitlines()
                if l.startswith("CMD "))
    return json.loads(line[4:])


def test_the_dockerfile_command_serves_and_generate_connects_as_separate_processes_with_auth():
    port, metrics_port = free_port(), free_port()
    cmd = dockerfile_command()
    assert cmd[:2] == ["specedge", "serve"]
    values = {"--host": "127.0.0.1", "--port": str(port), "--metrics-port": str(metrics_port), "--kv-pool-mb": "64"}
    args = [values.get(prev, a) for prev, a in zip([""] + cmd, cmd)]  # loopback and free ports, same flags
    script = Path(sys.executable).with_name("specedge")
    server = subprocess.Popen([str(script), *args[1:], "--auth-token", "t0k"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                try:
                    grpc.channel_ready_future(ch).result(timeout=1)
                    break
                except grpc.FutureTimeoutError:
                    assert server.poll() is None, server.stdout.read()
        out = subprocess.run([str(script), "generate", "The capital of France is", "--server", f"127.0.0.1:{port}",
                              "--auth-token", "t0k", "--max-new-tokens", "8", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["text"].startswith(" Paris")
        denied = subprocess.run([str(script), "generate", "hi", "--server", f"127.0.0.1:{port}",
                                 "--max-new-tokens", "4"],
                                capture_output=True, text=True, timeout=300)
        assert denied.returncode != 0 and "UNAUTHENTICATED" in denied.stderr
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "specedge_sessions_total" in metrics
    finally:
        server.terminate()  # SIGTERM: graceful drain, then exit
        assert server.wait(timeout=60) == 0
        log = server.stdout.read()
        assert '"event": "stopping"' in log and '"event": "stopped"' in log, log


SERVE_WITH_A_FAULTY_ENGINE = """
import sys
from specedge.cloud.engine import Engine
from specedge.cli import main

step, calls = Engine.step, [0]

def faulty_step(self, work, chunks=()):  # the fault a test injects: no real one is known
    calls[0] += 1
    if calls[0] == 4:
        raise SystemError("injected engine fault")
    return step(self, work, chunks)

Engine.step = faulty_step
sys.exit(main(sys.argv[1:]))
"""


def test_specedge_serve_exits_with_an_error_when_its_scheduler_fails_and_its_client_hears_unavailable():
    """`specedge serve` in its own process, its engine made to fail on the fourth step: the session in
    flight gets UNAVAILABLE (its SDK would resume elsewhere), and the process logs why and exits non-zero,
    for a supervisor to restart it."""
    from specedge.common.draft_tree import DraftTree
    from specedge.common.params import SamplingParams
    from specedge.edge.transport import RemoteVerifier

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVE_WITH_A_FAULTY_ENGINE, "serve", "--model", MODEL,
                               "--host", "127.0.0.1", "--port", str(port), "--kv-pool-mb", "64"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
        session = RemoteVerifier(f"127.0.0.1:{port}").open([1, 2, 3, 4], SamplingParams(max_new_tokens=20))
        with pytest.raises(grpc.RpcError) as failed:
            for _ in range(20):
                session.step(DraftTree.empty())
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "injected engine fault" in failed.value.details()
        assert server.wait(timeout=60) != 0
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read()
    assert '"event": "scheduler_failed"' in log and "the verify scheduler failed" in log, log
