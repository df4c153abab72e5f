"""The verifier over real gRPC on 127.0.0.1 (tiny model, token ids): the protocol is lossless, every bad
input gets its status code while the server keeps serving, auth and TLS are enforced, blocks come back
however a session ends, and a client resumes on another verifier without a visible break."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.cloud.local import LocalVerifier
from specedge.common.block_hash import prompt_block_hashes
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.ports import free_port
from specedge.edge.client import ChannelConfig, RemoteVerifier, ResumableSession
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.protos import verifier_pb2 as pb
from tiny_models import tiny_llama

V = 512
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10] * 3
GREEDY = SamplingParams(max_new_tokens=24)


def tiny_verifier(eos_token_id: int | None = None, **config) -> EmbeddedVerifier:
    hf = tiny_llama(vocab_size=V)
    hf.generation_config.eos_token_id = eos_token_id  # None: run to max_new_tokens, longer sessions to test
    settings = dict(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, max_new_tokens=256, gather_ms=1.0)
    return EmbeddedVerifier(ServerConfig(**{**settings, **config}), (hf, None))


@pytest.fixture(scope="module")
def server():
    with tiny_verifier(metrics_port=free_port()) as s:
        yield s


def chain_drafts(reference: list[int], depth: int = 4):
    """Drafts of the true continuation where known, else a wrong token."""

    def draft(committed: list[int]) -> DraftTree:
        n = len(committed)
        if committed == reference[:n] and n < len(reference):
            return DraftTree.chain(reference[n : n + depth])
        return DraftTree.chain([(committed[-1] + 1) % V])

    return draft


def healthy(server: EmbeddedVerifier) -> bool:
    with grpc.insecure_channel(server.target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specedge.v1.Verifier"))
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def solo_output(server: EmbeddedVerifier, prompt=PROMPT, params=GREEDY) -> list[int]:
    return generate(RemoteVerifier(server.target).open(prompt, params)).token_ids


# ---- protocol -----------------------------------------------------------------------------------------


def test_get_info_describes_model_limits_and_cost(server):
    info = RemoteVerifier(server.target).info
    assert info.vocab_size == V and info.model == "tiny" and info.tokenizer_fingerprint == "no-tokenizer"
    assert info.limits.max_tree_tokens == 32 and info.limits.max_new_tokens == 256
    assert list(info.cost.tree_tokens)[:2] == [0, 1] and all(ms > 0 for ms in info.cost.ms)


def test_remote_sessions_give_exactly_the_in_process_output_for_any_drafts(server):
    local = LocalVerifier(server.engine)  # the same engine, driven without the network
    want = generate(local.open(PROMPT, GREEDY)).token_ids
    wrong = FunctionDrafter(lambda c: DraftTree.chain([1, 2]))
    for drafts in (None, FunctionDrafter(chain_drafts(PROMPT + want)), wrong):
        got = generate(RemoteVerifier(server.target).open(PROMPT, GREEDY), drafter=drafts)
        assert got.token_ids == want
    oracle = generate(RemoteVerifier(server.target).open(PROMPT, GREEDY),
                      drafter=FunctionDrafter(chain_drafts(PROMPT + want)))
    assert oracle.rounds < len(want) / 2  # the drafts were really verified remotely
    assert server.used_blocks() == 0


def test_a_long_prompt_reports_its_prefill_progress_to_a_client_that_asks_and_the_output_is_unchanged(server):
    """max_batch_tokens 32: a 200-token prompt is prefilled in chunks; the client hears after each how far
    the verifier is, then gets the same output as from a verifier that prefills it in one step."""
    prompt = [(13 * i) % (V - 1) + 1 for i in range(200)]
    want = generate(RemoteVerifier(server.target).open(prompt, GREEDY)).token_ids
    with tiny_verifier(max_batch_tokens=32) as chunking:
        reports = []
        session = RemoteVerifier(chunking.target).open(prompt, GREEDY, on_prefill=lambda *r: reports.append(r))
        assert generate(session).token_ids == want
        assert len(reports) >= 5 and all(total == 200 for _, total in reports)
        assert [done for done, _ in reports] == sorted(done for done, _ in reports) and reports[-1][0] < 200
        # A client that does not ask hears nothing of it (a progress message would find no listener).
        assert generate(RemoteVerifier(chunking.target).open(prompt, GREEDY)).token_ids == want
        assert chunking.used_blocks() == 0


def test_a_client_gone_in_the_middle_of_a_chunked_prefill_leaves_no_blocks_held():
    with tiny_verifier(max_batch_tokens=8, kv_pool_mb=32) as s:
        prompt = [(13 * i) % (V - 1) + 1 for i in range(3000)]
        heard = threading.Event()
        session = RemoteVerifier(s.target).open(prompt, GREEDY, on_prefill=lambda *r: heard.set())
        session.send(DraftTree.empty())
        reader = threading.Thread(target=lambda: _swallow(session.receive))
        reader.start()
        assert heard.wait(30)
        session.verifier.close()  # the connection drops mid-prefill
        reader.join(timeout=30)
        assert s.used_blocks() == 0


def _swallow(call) -> None:
    try:
        call()
    except (grpc.RpcError, ValueError):
        pass


def test_a_client_drafting_more_than_the_verifier_takes_sends_what_it_takes(server):
    """This verifier takes 32 draft nodes a round (GetInfo's limits, read at connect): a drafter that
    proposes 60 has its trees cut to 32 instead of getting INVALID_ARGUMENT."""
    want = solo_output(server)
    too_big = FunctionDrafter(lambda c: DraftTree.chain([(c[-1] + 1 + i) % V for i in range(60)]))
    got = generate(RemoteVerifier(server.target).open(PROMPT, GREEDY), drafter=too_big)
    assert got.token_ids == want and max(got.tree_sizes) == 32


def test_server_side_generate_is_plain_decoding(server):
    want = solo_output(server)
    got = [t for tokens in RemoteVerifier(server.target).server_generate(PROMPT, GREEDY) for t in tokens]
    assert got == want
    assert server.used_blocks() == 0


def test_sampling_with_a_seed_is_reproducible_over_the_wire(server):
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=16)
    assert solo_output(server, params=params) == solo_output(server, params=params)


# ---- bad input ----------------------------------------------------------------------------------------


def open_raw(server: EmbeddedVerifier, *requests: pb.SessionRequest, metadata=()) -> list[pb.SessionResponse]:
    with grpc.insecure_channel(server.target) as ch:
        call = ch.stream_stream("/specedge.v1.Verifier/Session", request_serializer=pb.SessionRequest.SerializeToString,
                                response_deserializer=pb.SessionResponse.FromString)
        return list(call(iter(requests), metadata=metadata, timeout=30))


def opening(prompt=PROMPT, **params) -> pb.SessionRequest:
    return pb.SessionRequest(open=pb.OpenSession(prompt_ids=prompt, params=pb.SamplingParams(**params)))


def drafting(tokens, parents) -> pb.SessionRequest:
    return pb.SessionRequest(draft=pb.DraftTree(tokens=tokens, parents=parents))


BAD_SESSIONS = {
    "empty prompt": ([opening(prompt=[])], grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "prompt token out of range": ([opening(prompt=[1, V])], grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    "negative prompt token": ([opening(prompt=[-3, 1])], grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    "prompt too long": ([opening(prompt=[1] * 9000)], grpc.StatusCode.INVALID_ARGUMENT, "at most 8192"),
    "negative temperature": ([opening(temperature=-1)], grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p above 1": ([opening(top_p=1.5)], grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "negative top_k": ([opening(top_k=-2)], grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    "max_new_tokens over the limit": ([opening(max_new_tokens=100_000)], grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    "draft before open": ([drafting([1], [-1])], grpc.StatusCode.INVALID_ARGUMENT, "first message"),
    "parent after child": ([opening(), drafting([1, 2], [1, -1])], grpc.StatusCode.INVALID_ARGUMENT, "parent"),
    "parent is itself": ([opening(), drafting([1, 2], [-1, 1])], grpc.StatusCode.INVALID_ARGUMENT, "parent"),
    "arrays of different lengths": ([opening(), drafting([1, 2], [-1])], grpc.StatusCode.INVALID_ARGUMENT, "length"),
    "draft token out of range": ([opening(), drafting([V + 5], [-1])], grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "duplicate siblings": ([opening(), drafting([4, 4], [-1, -1])], grpc.StatusCode.INVALID_ARGUMENT, "same token"),
    "oversized tree": ([opening(), drafting(list(range(40)), list(range(-1, 39)))],
                       grpc.StatusCode.INVALID_ARGUMENT, "at most 32"),
    "wrong tokenizer": ([pb.SessionRequest(open=pb.OpenSession(prompt_ids=PROMPT, tokenizer_fingerprint="other"))],
                        grpc.StatusCode.FAILED_PRECONDITION, "fingerprint"),
    "open twice": ([opening(), opening()], grpc.StatusCode.INVALID_ARGUMENT, "expected a draft"),
    "empty message after open": ([opening(), pb.SessionRequest()], grpc.StatusCode.INVALID_ARGUMENT, "empty message"),
    "draft after close": ([opening(), pb.SessionRequest(close=pb.CloseSession()), drafting([1], [-1])],
                          grpc.StatusCode.INVALID_ARGUMENT, "after close"),
    "NaN acceptance estimate": ([opening(), pb.SessionRequest(draft=pb.DraftTree(
        tokens=[1], parents=[-1], accept_probs=[float("nan")]))], grpc.StatusCode.INVALID_ARGUMENT, "[0, 1]"),
    "infinite proposal probability": ([opening(temperature=1), pb.SessionRequest(draft=pb.DraftTree(
        tokens=[1], parents=[-1], proposals=[pb.Proposal(parent=-1, token_ids=[1, 2], probs=[float("inf"), 0])]))],
        grpc.StatusCode.INVALID_ARGUMENT, "finite"),
    "100,000-character client_id": (
        [pb.SessionRequest(open=pb.OpenSession(prompt_ids=PROMPT, client_id="x" * 100_000))],
        grpc.StatusCode.INVALID_ARGUMENT, "at most 128"),
    "client_id with a newline": ([pb.SessionRequest(open=pb.OpenSession(prompt_ids=PROMPT, client_id="a\nb"))],
                                 grpc.StatusCode.INVALID_ARGUMENT, "printable"),
    "10,000-character fingerprint": ([pb.SessionRequest(open=pb.OpenSession(prompt_ids=PROMPT,
                                                                            tokenizer_fingerprint="f" * 10_000))],
                                     grpc.StatusCode.FAILED_PRECONDITION, "(10000 characters)"),
}


@pytest.mark.parametrize("case", BAD_SESSIONS)
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, case):
    requests, code, message = BAD_SESSIONS[case]
    with pytest.raises(grpc.RpcError) as err:
        open_raw(server, *requests)
    assert err.value.code() == code, err.value.details()
    assert message in err.value.details()
    assert len(err.value.details()) < 500  # what the client sent is quoted in part, never whole
    assert healthy(server)
    assert server.used_blocks() == 0
    assert len(solo_output(server, params=SamplingParams(max_new_tokens=4))) == 4


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05\x01", b"\x12\x99\x99\x99\x99\x99\x99\x99\x99\x99"])
def test_undecodable_bytes_get_invalid_argument(server, garbage):
    with grpc.insecure_channel(server.target) as ch:
        call = ch.stream_stream("/specedge.v1.Verifier/Session")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([garbage]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        unary = ch.unary_unary("/specedge.v1.Verifier/GetInfo")
        with pytest.raises(grpc.RpcError) as err:
            unary(garbage, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert healthy(server)


def two_held_and_a_third_refused(verifier: RemoteVerifier, client_id: str, third_id: str | None = None):
    """Opens two sessions of `client_id` (they are served) and a third (as `third_id` if given), which must
    be refused with RESOURCE_EXHAUSTED -> (the two open sessions, the refusal's details)."""
    held = [verifier.open(PROMPT, GREEDY, client_id=client_id) for _ in range(2)]
    for h in held:
        h.step(DraftTree.empty())
    third = verifier.open(PROMPT, GREEDY, client_id=third_id or client_id)
    with pytest.raises(grpc.RpcError) as err:
        third.step(DraftTree.empty())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return held, err.value.details()


def tokens_file(tmp_path, **names) -> str:
    path = tmp_path / "tokens"
    path.write_text("# NAME TOKEN\n" + "".join(f"{name} {token}\n" for name, token in names.items()))
    return str(path)


def test_per_client_session_limit_counts_the_token_holder_not_the_client_id_it_declares(tmp_path):
    with tiny_verifier(max_sessions_per_client=2, auth_tokens=tokens_file(tmp_path, alice="a-t0k", bob="b-t0k")) as s:
        alice = RemoteVerifier(s.target, ChannelConfig(auth_token="a-t0k"))
        held = [alice.open(PROMPT, GREEDY, client_id=f"made-up-{i}") for i in range(2)]
        for h in held:
            h.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:  # a third made-up id is still alice
            alice.open(PROMPT, GREEDY, client_id="made-up-2").step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'token:alice' already has 2 open sessions" in err.value.details()
        bob = RemoteVerifier(s.target, ChannelConfig(auth_token="b-t0k")).open(PROMPT, GREEDY, client_id="made-up-0")
        bob.step(DraftTree.empty())  # other clients are not affected
        with pytest.raises(grpc.RpcError) as err:
            RemoteVerifier(s.target, ChannelConfig(auth_token="forged"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for h in held + [bob]:
            h.close()
        assert s.used_blocks() == 0


def test_without_authentication_the_limits_count_the_client_address():
    with tiny_verifier(max_sessions_per_client=2) as s:
        verifier = RemoteVerifier(s.target)
        held, refusal = two_held_and_a_third_refused(verifier, "one-id", third_id="another-id")
        assert "'peer:ipv4:127.0.0.1' already has 2 open sessions" in refusal
        for h in held:
            h.close()
        assert s.used_blocks() == 0


def test_per_client_token_limit_counts_prompt_plus_max_new_tokens_and_is_given_back_on_close():
    claim = len(PROMPT) + GREEDY.max_new_tokens
    with tiny_verifier(max_tokens_per_client=2 * claim + 30) as s:
        verifier = RemoteVerifier(s.target)
        assert verifier.info.limits.max_tokens_per_client == 2 * claim + 30
        held, refusal = two_held_and_a_third_refused(verifier, "big-client")
        assert "would pass its limit" in refusal
        small = verifier.open(PROMPT, SamplingParams(max_new_tokens=4), client_id="big-client")
        assert len(generate(small).token_ids) == 4  # a session that fits in what is left is served
        held.pop().close()
        again = verifier.open(PROMPT, GREEDY, client_id="big-client")
        assert len(generate(again).token_ids) == GREEDY.max_new_tokens  # the closed session's claim was given back
        for h in held:
            h.close()
        assert s.used_blocks() == 0


def test_a_prompt_larger_than_the_kv_pool_is_refused_and_others_are_served():
    with tiny_verifier(kv_pool_mb=1) as s:  # tiny llama: 2 layers x 2 kv heads x 16 dims -> 64 blocks of 16
        blocks = s.engine.pool.num_blocks
        with pytest.raises(grpc.RpcError) as err:
            generate(RemoteVerifier(s.target).open([5] * (blocks * 16 + 10), GREEDY))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool" in err.value.details()
        assert len(solo_output(s)) == GREEDY.max_new_tokens
        assert s.used_blocks() == 0


def test_a_client_that_gives_up_while_its_prompt_waits_for_blocks_leaks_nothing():
    with tiny_verifier(kv_pool_mb=1) as s:
        blocks = s.engine.pool.num_blocks
        verifier = RemoteVerifier(s.target)
        big = verifier.open([5] * ((blocks - 2) * 16), GREEDY)
        big.step(DraftTree.empty())  # holds nearly every block
        impatient = RemoteVerifier(s.target, ChannelConfig(rpc_timeout_s=0.5)).open([6] * (4 * 16), GREEDY)
        with pytest.raises(grpc.RpcError) as err:
            impatient.step(DraftTree.empty())  # waits for blocks, then its deadline passes
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        big.close()  # now the waiting prompt gets its blocks, and must give them back at once
        assert s.used_blocks() == 0
        assert len(solo_output(s)) == GREEDY.max_new_tokens


def test_a_session_refused_while_the_pool_is_full_resumes_later_and_its_output_is_unbroken():
    with tiny_verifier(kv_pool_mb=1) as s:
        blocks = s.engine.pool.num_blocks
        params = SamplingParams(max_new_tokens=256)  # 16 blocks of 16 tokens
        # Both prompts fit at once and each fits with its output, but both outputs together do not.
        prompts = [[5 + i] * ((blocks // 2 - 12) * 16) for i in range(2)]
        want = [solo_output(s, p, params) for p in prompts]
        sessions = [ResumableSession(lambda: RemoteVerifier(s.target), p, params, f"client-{i}", "")
                    for i, p in enumerate(prompts)]
        got = [None, None]

        def run(i: int) -> None:
            got[i] = generate(sessions[i]).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == want  # the youngest was stopped (RESOURCE_EXHAUSTED, retry after 1 s) and resumed
        assert sum(x.resumes for x in sessions) >= 1
        assert s.used_blocks() == 0


def test_an_idle_session_is_closed_and_its_blocks_released():
    with tiny_verifier(idle_timeout_s=0.5) as s:
        session = RemoteVerifier(s.target).open(PROMPT, GREEDY)
        session.step(DraftTree.empty())
        assert s.engine.pool.stats().used > 0
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as err:
            session.step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert s.used_blocks() == 0


def test_a_client_killed_mid_stream_releases_its_blocks(server):
    baseline = server.used_blocks()
    script = textwrap.dedent(f"""
        import os, signal, sys
        from specedge.edge.client import RemoteVerifier
        from specedge.common.draft_tree import DraftTree
        from specedge.common.params import SamplingParams
        s = RemoteVerifier({server.target!r}).open({PROMPT * 4!r}, SamplingParams(max_new_tokens=200))
        s.step(DraftTree.empty())
        s.step(DraftTree.chain([1, 2, 3]))
        print("open", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "open"
    assert server.engine.pool.stats().used > baseline
    assert scraped_kv_blocks(server, "used") == server.engine.pool.stats().used
    child.kill()  # SIGKILL: no close, no goodbye
    child.wait()
    assert server.used_blocks(baseline) == baseline
    assert scraped_kv_blocks(server, "used") == baseline  # the metrics show the release without a step since
    assert healthy(server)


def scraped_kv_blocks(server: EmbeddedVerifier, state: str) -> float:
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.service.config.metrics_port}/metrics").read().decode()
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith(f'specedge_kv_blocks{{state="{state}"}}'))


# ---- security -----------------------------------------------------------------------------------------


def test_bearer_token_is_required_for_the_verifier_but_not_for_health_checks():
    with tiny_verifier(auth_token="s3cret") as s:
        for token in (None, "wrong"):
            with pytest.raises(grpc.RpcError) as err:
                RemoteVerifier(s.target, ChannelConfig(auth_token=token))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            open_raw(s, opening(), metadata=[("authorization", "Bearer wrong")])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert healthy(s)
        good = RemoteVerifier(s.target, ChannelConfig(auth_token="s3cret"))
        assert len(generate(good.open(PROMPT, GREEDY)).token_ids) == GREEDY.max_new_tokens


def test_tls_is_required_when_configured(certs):
    with tiny_verifier(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key")) as s:
        with pytest.raises(grpc.RpcError) as err:
            RemoteVerifier(s.target, ChannelConfig(rpc_timeout_s=5))  # plaintext client
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        secure = RemoteVerifier(s.target, ChannelConfig(tls_ca=str(certs / "ca.pem")))
        assert len(generate(secure.open(PROMPT, GREEDY)).token_ids) == GREEDY.max_new_tokens


def test_mutual_tls_refuses_clients_without_a_certificate(certs):
    with tiny_verifier(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"),
                       tls_client_ca=str(certs / "ca.pem")) as s:
        with pytest.raises(grpc.RpcError) as err:
            RemoteVerifier(s.target, ChannelConfig(tls_ca=str(certs / "ca.pem")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        mutual = RemoteVerifier(s.target, ChannelConfig(tls_ca=str(certs / "ca.pem"),
                                                        tls_cert=str(certs / "client.pem"),
                                                        tls_key=str(certs / "client.key")))
        assert len(generate(mutual.open(PROMPT, GREEDY)).token_ids) == GREEDY.max_new_tokens


def test_under_mutual_tls_the_limits_count_the_certificate_holder(certs):
    with tiny_verifier(tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server.key"),
                       tls_client_ca=str(certs / "ca.pem"), max_sessions_per_client=1) as s:
        mutual = RemoteVerifier(s.target, ChannelConfig(tls_ca=str(certs / "ca.pem"),
                                                        tls_cert=str(certs / "client.pem"),
                                                        tls_key=str(certs / "client.key")))
        held = mutual.open(PROMPT, GREEDY, client_id="one")
        held.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:
            mutual.open(PROMPT, GREEDY, client_id="another").step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'cert:client' already has 1 open sessions" in err.value.details()
        held.close()
        assert s.used_blocks() == 0


# ---- operations ---------------------------------------------------------------------------------------


def test_concurrent_sessions_share_engine_steps_and_metrics_show_it(server):
    prompts = [[(7 * i + j) % V for j in range(12 + i)] for i in range(8)]
    solo = [solo_output(server, p) for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        results[i] = solo_output(server, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.service.config.metrics_port}/metrics").read().decode()
    multi = [line for line in metrics.splitlines() if line.startswith("specedge_batch_sessions_bucket")]
    le1 = next(float(l.split()[-1]) for l in multi if 'le="1.0"' in l)
    total = next(float(l.split()[-1]) for l in multi if 'le="+Inf"' in l)
    assert total > le1  # some steps carried more than one session
    assert "specedge_kv_blocks" in metrics and "specedge_step_seconds" in metrics
    assert server.used_blocks() == 0


def test_the_client_resumes_on_another_verifier_and_the_output_is_unbroken():
    with tiny_verifier() as a, tiny_verifier() as b:
        params = SamplingParams(max_new_tokens=40)
        want = solo_output(a, params=params)
        targets = iter([a.target, b.target])
        session = ResumableSession(lambda: RemoteVerifier(next(targets)), PROMPT, params, "c", "")
        steps = [0]

        def kill_a_midway(committed: list[int]) -> DraftTree:
            steps[0] += 1
            if steps[0] == 6:
                a.stop(grace_s=0)  # the verifier goes away mid-generation
            return DraftTree.chain([(committed[-1] + 1) % V])

        got = generate(session, drafter=FunctionDrafter(kill_a_midway))
        assert session.resumes == 1
        assert got.token_ids == want
        assert b.used_blocks() == 0


def test_a_verifier_whose_scheduler_fails_sends_its_clients_elsewhere_and_stops_serving():
    """An error inside an engine step (injected here: no real one is known) ends the scheduler: its clients
    get UNAVAILABLE instead of waiting forever for a thread that is gone, resume on another verifier with
    unchanged output, and the failed verifier reports NOT_SERVING and refuses new sessions at once."""
    with tiny_verifier() as a, tiny_verifier() as b:
        params = SamplingParams(max_new_tokens=40)
        want = solo_output(b, params=params)
        step, calls = a.engine.step, [0]

        def step_that_fails_the_sixth_time(work, chunks):
            calls[0] += 1
            if calls[0] == 6:
                raise SystemError("injected engine fault")
            return step(work, chunks)

        a.engine.step = step_that_fails_the_sixth_time
        targets = iter([a.target, b.target])
        session = ResumableSession(lambda: RemoteVerifier(next(targets)), PROMPT, params, "c", "")
        got = generate(session, drafter=FunctionDrafter(lambda c: DraftTree.chain([(c[-1] + 1) % V])))
        assert session.resumes == 1 and got.token_ids == want
        assert isinstance(a.service.scheduler.failure, SystemError)
        deadline = time.monotonic() + 10
        while healthy(a) and time.monotonic() < deadline:  # reported from the server's event loop
            time.sleep(0.02)
        assert not healthy(a)
        with pytest.raises(grpc.RpcError) as refused:
            generate(RemoteVerifier(a.target).open(PROMPT, GREEDY))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_graceful_shutdown_lets_open_sessions_finish_and_refuses_new_ones():
    s = tiny_verifier()
    verifier = RemoteVerifier(s.target)
    session = verifier.open(PROMPT, SamplingParams(max_new_tokens=60))
    session.step(DraftTree.empty())
    stopper = threading.Thread(target=s.stop, kwargs={"grace_s": 20})
    stopper.start()
    time.sleep(0.3)
    with pytest.raises(grpc.RpcError) as err:
        generate(verifier.open(PROMPT, GREEDY))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for _ in range(10):  # the open session still works while the server drains
        session.step(DraftTree.empty())
    session.close()
    stopper.join(timeout=30)
    assert not stopper.is_alive()


def drain(verifier: EmbeddedVerifier) -> int:
    with grpc.insecure_channel(verifier.target) as channel:
        call = channel.unary_unary("/specedge.v1.Verifier/Drain", request_serializer=pb.DrainRequest.SerializeToString,
                                   response_deserializer=pb.DrainReply.FromString)
        return call(pb.DrainRequest(), timeout=10).sessions


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(temperature=1.0, seed=7, max_new_tokens=40)],
                         ids=["greedy", "seeded"])
def test_a_drained_verifier_moves_its_live_session_and_the_output_is_unchanged(params):
    """Drain ends the session between rounds; the client reopens it on the other verifier with
    the prompt plus the committed tokens. Seeded sampling draws by position, so it too comes out the same."""
    with tiny_verifier() as a, tiny_verifier() as b:
        want = solo_output(b, params=params)
        targets = iter([a.target, b.target])
        session = ResumableSession(lambda: RemoteVerifier(next(targets)), PROMPT, params, "c", "")
        steps, moved = [0], []

        def drain_a_midway(committed: list[int]) -> DraftTree:
            steps[0] += 1
            if steps[0] == 6:
                moved.append(drain(a))
            return DraftTree.chain([(committed[-1] + 1) % V])

        got = generate(session, drafter=FunctionDrafter(drain_a_midway))
        assert moved == [1] and session.resumes == 1
        assert got.token_ids == want
        assert a.used_blocks() == 0 and b.used_blocks() == 0
        assert not healthy(a)  # a draining verifier tells load balancers to look elsewhere
        with pytest.raises(grpc.RpcError) as refused:
            generate(RemoteVerifier(a.target).open(PROMPT, GREEDY))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_seeded_sampling_gives_the_same_tokens_with_drafts_as_without(server):
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=40)
    plain = list(itertools.chain.from_iterable(RemoteVerifier(server.target).server_generate(PROMPT, params)))
    drafted = generate(RemoteVerifier(server.target).open(PROMPT, params),
                       drafter=FunctionDrafter(chain_drafts(PROMPT + plain, depth=5)))
    assert drafted.token_ids == plain
    assert drafted.rounds < len(plain) / 2  # the drafts were accepted, not just ignored


def watch_cache(channel: grpc.Channel):
    return channel.unary_stream("/specedge.v1.Verifier/WatchCache",
                                request_serializer=pb.WatchCacheRequest.SerializeToString,
                                response_deserializer=pb.CacheUpdate.FromString)(pb.WatchCacheRequest(), timeout=120)


def test_watch_cache_reports_the_prompt_blocks_the_verifier_holds_and_its_load():
    with tiny_verifier() as v, grpc.insecure_channel(v.target) as channel:
        watch = watch_cache(channel)
        first = next(watch)
        assert first.snapshot and first.block_size == 16 and not first.stored
        prompt = list(range(1, 50))  # 3 full blocks before the last token's
        generate(RemoteVerifier(v.target).open(prompt, SamplingParams(max_new_tokens=2)))
        held: set[int] = set()
        for update in watch:  # the load comes at least every 250 ms: the session's end shows soon
            held |= set(update.stored)
            if set(prompt_block_hashes(prompt, 16)) <= held and update.load.active_sessions == 0:
                break
        assert not update.load.draining
        drain(v)
        assert next(watch).load.draining
        watch.cancel()


def test_a_stopping_verifier_ends_its_cache_watches_instead_of_waiting_out_its_grace_for_them():
    """A router watches every verifier of its fleet for as long as both run: a watch is no session to drain,
    so a stop with no sessions left ends the watches (cleanly: status OK) and returns."""
    with tiny_verifier() as v, grpc.insecure_channel(v.target) as channel:
        call = watch_cache(channel)
        assert next(call).snapshot
        started = time.monotonic()
        v.stop(grace_s=60)
        assert time.monotonic() - started < 30  # waiting out the grace would take 60 s
        for _ in call:  # any report still on its way, then the end
            pass
        assert call.code() == grpc.StatusCode.OK


def test_a_cache_watch_opened_while_the_verifier_stops_ends_at_once():
    with tiny_verifier() as v, grpc.insecure_channel(v.target) as channel:
        v.service.cache_watchers.close()  # what a stop does once its sessions are gone, before the server stops
        call = watch_cache(channel)
        assert list(call) == [] and call.code() == grpc.StatusCode.OK


def test_flush_cache_makes_a_seen_prompt_prefill_anew_and_live_sessions_keep_theirs():
    """What `specedge bench` relies on to run every method against one verifier: after FlushCache no prompt
    finds another generation's prefill in the cache, while a session open across the flush is unharmed."""
    prompt = list(range(1, 50))  # 3 full blocks before the last token's

    def cached_on_open() -> int:
        return open_raw(v, opening(prompt, max_new_tokens=2))[0].opened.cached_prompt_tokens

    with tiny_verifier() as v:
        client = RemoteVerifier(v.target)
        assert cached_on_open() == 0
        assert cached_on_open() == 48
        live = client.open(PROMPT, GREEDY)
        output = live.step(DraftTree.empty()).tokens
        assert client.flush_cache() == 3  # the prompt's blocks; the live session's stay held
        assert cached_on_open() == 0
        while len(output) < GREEDY.max_new_tokens:
            output += live.step(DraftTree.empty()).tokens
        live.close()
        assert output == solo_output(v)
        assert client.flush_cache() >= 1  # the live session's, now that it ended
        client.close()


def test_a_drain_moves_a_session_whose_prefill_still_waits_at_once():
    """Engine steps never run here (scheduler_thread=False and nobody runs it): the open waits in the queue,
    and the drain ends it anyway; a drain does not wait for queued work to be done."""
    hf = tiny_llama(vocab_size=V)
    with EmbeddedVerifier(ServerConfig(model="tiny", port=0, kv_pool_mb=8), (hf, None), scheduler_thread=False) as v:
        errors = []

        def open_session() -> None:
            try:
                RemoteVerifier(v.target).open(PROMPT, GREEDY).step(DraftTree.empty())
            except grpc.RpcError as e:
                errors.append(e)

        opener = threading.Thread(target=open_session)
        opener.start()
        deadline = time.monotonic() + 10
        while v.service.scheduler.waiting_requests < 1:
            assert time.monotonic() < deadline, "the open never reached the scheduler"
            time.sleep(0.01)
        assert drain(v) == 1
        opener.join(timeout=10)
        assert not opener.is_alive()
        assert errors[0].code() == grpc.StatusCode.UNAVAILABLE
        assert ("specedge-migrate", "1") in tuple(errors[0].trailing_metadata())
