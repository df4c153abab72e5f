"""`specedge edge-serve`: the OpenAI API on the edge, used through the official `openai` client as an app
would, over real HTTP on 127.0.0.1, against a real verifier (gRPC, loopback) with the real model. Greedy
output equals `specedge generate`'s, streamed or not; the API's fields, limits and errors are honoured."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from specedge.cli import main
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.edge.client import EdgeClient
from specedge.edge.openai_server import HttpServer, create_app

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"
PROMPT = "Summarize: The committee met on Tuesday to review the bridge repair plan. Engineers said the north span " \
         "needs new bearings before winter, while the south span can wait until spring."


@pytest.fixture(scope="module")
def verifier(real_model):
    with EmbeddedVerifier(ServerConfig(model=MODEL, port=0, kv_pool_mb=256), real_model(MODEL)) as v:
        yield v


@pytest.fixture(scope="module")
def server(verifier):
    client = EdgeClient(verifier.target, drafter="retrieval")
    http = HttpServer(create_app(client, api_key="sk-test"), port=0).start()
    yield http
    http.stop()
    client.close()


@pytest.fixture(scope="module")
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="sk-test", max_retries=0, timeout=300)


def specedge_generate(capsys, verifier, prompt: str, *flags: str) -> dict:
    """`specedge generate --json` against the same verifier, in this process."""
    code = main(["generate", prompt, "--server", verifier.target, "--drafter", "retrieval", "--json", *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_the_model_list_names_the_served_model(api):
    assert [m.id for m in api.models.list()] == [MODEL]


def test_chat_completion_greedy_equals_specedge_generate_streamed_or_not(api, verifier, capsys):
    want = specedge_generate(capsys, verifier, PROMPT, "--chat", "--max-new-tokens", "48")
    messages = [{"role": "user", "content": PROMPT}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    assert whole.choices[0].message.content == want["text"]
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == want["num_tokens"]
    assert whole.choices[0].finish_reason == ("length" if want["num_tokens"] == 48 else "stop")
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want["num_tokens"]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed in pieces


def test_completion_greedy_equals_specedge_generate_and_stops_before_a_stop_string(api, verifier, capsys):
    prompt = "Count: 1, 2, 3,"
    want = specedge_generate(capsys, verifier, prompt, "--max-new-tokens", "16")
    assert " 6" in want["text"]  # the premise: the model keeps counting
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.choices[0].text == want["text"] and whole.usage.completion_tokens == want["num_tokens"]
    cut = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[" 6", "zzz"])
    assert cut.choices[0].text == want["text"].split(" 6")[0]
    assert cut.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=" 6",
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_max_tokens_ends_with_length_and_the_usage_counts_add_up(api):
    r = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    default = api.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert default.usage.completion_tokens == 16  # the API's default max_tokens for completions


def test_sampling_with_a_seed_is_reproducible_through_the_api(api):
    def sample(seed: int) -> str:
        return api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      top_p=0.95, seed=seed).choices[0].text

    assert sample(7) == sample(7) != sample(8)


def test_concurrent_requests_each_get_their_solo_output(api):
    prompts = ["List three colours.", "What is the capital of France?", "Write a haiku about rain.",
               "Name two prime numbers."]

    def ask(prompt: str) -> str:
        return api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0).choices[0].message.content

    solo = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == solo


@pytest.mark.parametrize("kwargs, error, param", [
    ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ({"n": 2}, openai.BadRequestError, "n"),
    ({"temperature": 3.0}, openai.BadRequestError, "temperature"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ({"max_tokens": 10**6}, openai.BadRequestError, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop"),
    ({"logprobs": True}, openai.BadRequestError, "logprobs"),
    ({"presence_penalty": 0.5}, openai.BadRequestError, "presence_penalty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, openai.BadRequestError, "messages"),
    ({"messages": []}, openai.BadRequestError, "messages"),
])
def test_a_request_the_server_cannot_honour_gets_the_apis_error_naming_the_field(api, kwargs, error, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | kwargs
    with pytest.raises(error) as caught:
        api.chat.completions.create(**request)
    assert caught.value.body["param"] == param and caught.value.body["message"]


def test_a_prompt_longer_than_the_verifier_takes_is_a_400_and_the_server_serves_on(api, verifier):
    too_long = list(range(10, 10 + verifier.service.config.max_prompt_tokens + 1))
    with pytest.raises(openai.BadRequestError, match="at most"):
        api.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    assert api.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0).usage.completion_tokens


def test_without_the_api_key_requests_are_refused(server):
    wrong = openai.OpenAI(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_streaming_client_that_hangs_up_ends_its_generation_and_frees_its_kv_blocks(api, verifier):
    assert verifier.used_blocks(want=0) == 0
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                         max_tokens=3000, temperature=0, stream=True)
    next(iter(stream)), next(iter(stream))  # the generation is under way
    assert verifier.engine.pool.stats().used > 0
    stream.close()  # hangs up; 3,000 tokens would take minutes to generate
    assert verifier.used_blocks(want=0, wait_s=20) == 0


def test_the_address_accepts_connections_from_the_moment_it_is_known():
    """edge-serve prints its URL before uvicorn starts: a client that connects then waits in the socket's
    backlog instead of being refused."""
    import socket

    async def app(scope, receive, send) -> None:  # never called: nothing is served here
        raise AssertionError("not serving")

    server = HttpServer(app, port=0)  # bound, not yet serving
    try:
        socket.create_connection((server.host, server.port), timeout=5).close()
    finally:
        server.socket.close()


def test_edge_serve_command_serves_the_api_against_a_verifier(verifier, tmp_path):
    """The command itself, as deployed: `specedge edge-serve --server ...` on a free port."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("specedge")
    proc = subprocess.Popen([str(script), "edge-serve", "--server", verifier.target, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:  # the command says where it listens, then uvicorn logs
            if "OpenAI API on " in line:
                url = line.split("OpenAI API on ")[1].split()[0]
                break
        assert url is not None, "edge-serve exited without serving"
        log: list[str] = []
        drain = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        drain.start()
        api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                        max_tokens=4, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    drain.join(timeout=30)
    # uvicorn drains open requests on SIGTERM, then ends by the signal (exit status -15) as it should.
    assert "Finished server process" in "".join(log), log
