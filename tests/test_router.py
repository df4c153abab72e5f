"""The router (cloud/router/) in front of tiny verifiers, over real gRPC on 127.0.0.1: relayed sessions
give the verifiers' own output; placement follows the verifiers' reported prefix caches (an eviction
redirects the next session; a saturated verifier does not turn affinity off for the others); verifiers
join by registering and leave when they stop answering; a drain or a lost verifier moves live sessions
with the output unchanged."""

from __future__ import annotations

import itertools
import threading
import time

import grpc
import pytest
from test_grpc import GREEDY, PROMPT, V, open_raw, opening, solo_output, tiny_verifier

from specedge.cloud.identity import CLIENT_IDENTITY
from specedge.cloud.router.config import RouterConfig
from specedge.cloud.router.server import EmbeddedRouter
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableGenerate, ResumableSession
from specedge.edge.transport import ChannelConfig, RemoteVerifier
from specedge.protos import router_pb2 as rpb

DOCUMENT = [(7 * i) % (V - 2) + 2 for i in range(64)]  # 4 blocks of 16 tokens


def router_for(*verifiers, **config) -> EmbeddedRouter:
    router = EmbeddedRouter(RouterConfig(port=0, verifiers=",".join(v.target for v in verifiers), **config))
    wait_for(lambda: len(router.call(router.fleet.pool)) == len(verifiers), "the verifiers to join")
    return router


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.02)


def listing(router: EmbeddedRouter) -> dict[str, rpb.VerifierStatus]:
    with grpc.insecure_channel(router.target) as channel:
        reply = channel.unary_unary("/specedge.v1.Router/ListVerifiers",
                                    request_serializer=rpb.ListVerifiersRequest.SerializeToString,
                                    response_deserializer=rpb.VerifierList.FromString)(rpb.ListVerifiersRequest())
    return {v.address: v for v in reply.verifiers}


def cached_blocks(router: EmbeddedRouter, verifier) -> int:
    return listing(router)[verifier.target].cached_blocks


def sessions_opened(verifier) -> int:
    return sum(sample.value for metric in verifier.service.metrics.sessions_total.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


def through(router: EmbeddedRouter, prompt, params=SamplingParams(max_new_tokens=8)) -> list[int]:
    return generate(RemoteVerifier(router.target).open(prompt, params)).token_ids


def test_a_session_through_the_router_gives_the_verifiers_own_output():
    with tiny_verifier() as a, tiny_verifier() as b, router_for(a, b) as router:
        params = SamplingParams(max_new_tokens=30)
        assert through(router, PROMPT, params) == solo_output(a, params=params)
        verifier = RemoteVerifier(router.target)
        assert verifier.info.vocab_size == V
        assert list(verifier.server_generate(PROMPT, SamplingParams(max_new_tokens=5))) != []


def test_the_same_document_goes_to_the_verifier_that_holds_it_and_an_eviction_redirects_it():
    with tiny_verifier() as a, tiny_verifier() as b, router_for(a, b) as router:
        solo_output(a, prompt=DOCUMENT + [3], params=SamplingParams(max_new_tokens=2))  # a now holds it
        wait_for(lambda: cached_blocks(router, a) == 4, "the router to learn what a holds")
        before = sessions_opened(a), sessions_opened(b)
        for question in range(4):
            through(router, DOCUMENT + [10 + question, 11])
        assert (sessions_opened(a) - before[0], sessions_opened(b) - before[1]) == (4, 0)

        assert a.used_blocks() == 0  # its sessions have ended ...
        a.engine.pool.drop_cached()  # ... so a evicts the document ...
        solo_output(b, prompt=DOCUMENT + [4], params=SamplingParams(max_new_tokens=2))  # ... and b takes it
        wait_for(lambda: cached_blocks(router, a) == 0 and cached_blocks(router, b) == 4, "the eviction to show")
        before = sessions_opened(a), sessions_opened(b)
        through(router, DOCUMENT + [20, 21])
        assert (sessions_opened(a) - before[0], sessions_opened(b) - before[1]) == (0, 1)


def test_a_saturated_verifier_loses_its_documents_but_affinity_holds_for_the_others():
    with tiny_verifier() as a, tiny_verifier() as b, tiny_verifier() as c, \
            router_for(a, b, c, balance_threshold=2) as router:
        other = [d + 1 for d in DOCUMENT]
        solo_output(a, prompt=DOCUMENT + [3], params=SamplingParams(max_new_tokens=2))
        solo_output(b, prompt=other + [3], params=SamplingParams(max_new_tokens=2))
        held = [RemoteVerifier(a.target).open(PROMPT, SamplingParams(max_new_tokens=200)) for _ in range(5)]
        for session in held:  # a is busy with 5 open sessions
            session.step(DraftTree.empty())
        wait_for(lambda: listing(router)[a.target].active_sessions == 5 and cached_blocks(router, b) == 4,
                 "the router to see a's load and b's cache")
        before = [sessions_opened(v) for v in (a, b, c)]
        through(router, DOCUMENT + [30, 31])  # a holds it but is over the threshold: the least loaded gets it
        through(router, other + [30, 31])  # b holds this one and is not saturated: affinity holds
        after = [sessions_opened(v) for v in (a, b, c)]
        assert [x - y for x, y in zip(after, before)] in ([0, 1, 1], [0, 2, 0])
        assert after[1] - before[1] >= 1
        for session in held:
            session.close()


def test_verifiers_join_by_registering_and_a_stopped_one_leaves_the_pool_within_2_s():
    with EmbeddedRouter(RouterConfig(port=0)) as router, \
            tiny_verifier(register=router.target) as a, tiny_verifier(register=router.target) as b:
        wait_for(lambda: len(router.call(router.fleet.pool)) == 2, "both verifiers to register")
        assert through(router, PROMPT) == solo_output(a, params=SamplingParams(max_new_tokens=8))
        a.kill()  # a stops answering: no goodbye, no drain
        stopped = time.monotonic()
        wait_for(lambda: [m.address for m in router.call(router.fleet.pool)] == [b.target], "a to leave", 2.5)
        assert time.monotonic() - stopped < 2.0
        assert a.target not in router.call(lambda: router.fleet.index._held)  # out of the affinity index too


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(temperature=1.0, seed=5, max_new_tokens=40)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("fault", ["drain", "stop"])
def test_a_session_moves_through_the_router_with_its_output_unchanged(fault, params):
    with tiny_verifier() as a, tiny_verifier() as b, router_for(a, b) as router:
        want = solo_output(b, params=params)
        assert b.used_blocks() == 0
        b.engine.pool.drop_cached()  # so the session starts on a (least loaded, then by address)
        wait_for(lambda: cached_blocks(router, b) == 0, "b's cache to empty")
        session = ResumableSession(lambda: RemoteVerifier(router.target), PROMPT, params, "c", "")
        steps = [0]
        first = []

        def fault_midway(committed: list[int]) -> DraftTree:
            steps[0] += 1
            if steps[0] == 2:
                first.append(next(v for v in (a, b) if v.service.sessions_by_client))
            if steps[0] == 6:
                holder = first[0]
                if fault == "drain":
                    with grpc.insecure_channel(router.target) as channel:
                        channel.unary_unary("/specedge.v1.Router/Drain",
                                            request_serializer=rpb.DrainVerifierRequest.SerializeToString,
                                            response_deserializer=rpb.DrainVerifierReply.FromString)(
                            rpb.DrainVerifierRequest(address=holder.target), timeout=10)
                else:
                    holder.kill()  # gone mid-generation
            return DraftTree.chain([(committed[-1] + 1) % V])

        started = time.monotonic()
        got = generate(session, drafter=FunctionDrafter(fault_midway))
        assert got.token_ids == want
        assert session.resumes == 1
        assert time.monotonic() - started < 10


def pause_the_first_to_reach(nth: int, verifiers) -> tuple[threading.Event, threading.Event, list]:
    """Make the first of `verifiers` whose engine reaches its `nth` step wait there until `go` is set
    (its scheduler thread only; its gRPC server goes on): (paused, go, [that verifier] once paused)."""
    paused, go, which, lock = threading.Event(), threading.Event(), [], threading.Lock()
    for v in verifiers:
        def paused_step(*args, _v=v, _step=v.engine.step, _count=itertools.count(1), **kwargs):
            if next(_count) == nth:
                with lock:
                    first = not which
                    if first:
                        which.append(_v)
                if first:
                    paused.set()
                    go.wait(30)
            return _step(*args, **kwargs)
        v.engine.step = paused_step
    return paused, go, which


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                    SamplingParams(temperature=1.0, seed=5, max_new_tokens=40)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("fault", ["drain", "stop"])
def test_plain_decoding_on_the_verifier_moves_through_the_router_with_its_output_unchanged(fault, params):
    """The `Generate` RPC, stopped between steps by a drain (or its verifier gone), is asked for again with
    what it gave (edge/resume.py, ResumableGenerate) and ends as it would have."""
    with tiny_verifier() as a, tiny_verifier() as b, router_for(a, b) as router:
        want = [t for piece in RemoteVerifier(b.target).server_generate(PROMPT, params) for t in piece]
        assert len(want) == params.max_new_tokens and b.used_blocks() == 0
        b.engine.pool.drop_cached()
        wait_for(lambda: cached_blocks(router, b) == 0, "b's cache to empty")
        paused, go, holder = pause_the_first_to_reach(6, (a, b))  # the one the stream is on

        def fault_midway() -> None:
            assert paused.wait(30), "no verifier reached its sixth step"
            if fault == "drain":
                with grpc.insecure_channel(router.target) as channel:
                    channel.unary_unary("/specedge.v1.Router/Drain",
                                        request_serializer=rpb.DrainVerifierRequest.SerializeToString,
                                        response_deserializer=rpb.DrainVerifierReply.FromString)(
                        rpb.DrainVerifierRequest(address=holder[0].target), timeout=10)
            else:
                holder[0].kill()
            go.set()

        faulting = threading.Thread(target=fault_midway)
        faulting.start()
        stream = ResumableGenerate(lambda: RemoteVerifier(router.target), PROMPT, params)
        pieces = list(stream)
        faulting.join()
        assert [t for piece in pieces for t in piece] == want
        assert stream.resumes == 1 and len(pieces) > 1
        assert holder[0].used_blocks() == 0  # the dropped step's sequence is freed


def test_a_client_that_goes_away_mid_session_frees_the_verifier_behind_the_router():
    with tiny_verifier() as a, router_for(a) as router:
        client = RemoteVerifier(router.target)
        session = client.open(PROMPT, SamplingParams(max_new_tokens=100))
        session.step(DraftTree.empty())
        assert a.used_blocks(want=1, wait_s=0) > 0
        client.channel.close()  # the client vanishes without closing its session
        assert a.used_blocks() == 0
        wait_for(lambda: router.call(lambda: router.fleet.members[a.target].relayed) == 0, "the relay to end")


def test_a_verifier_that_trusts_the_router_counts_limits_by_the_clients_the_router_authenticated(tmp_path):
    """Relayed sessions all come from the router's address: without the identity it passes on they would
    share one quota, and with a client_id they would each choose their own."""
    (tmp_path / "verifier").write_text("router r-t0k\n")
    (tmp_path / "router").write_text("alice a-t0k\nbob b-t0k\n")
    with tiny_verifier(max_sessions_per_client=2, auth_tokens=str(tmp_path / "verifier"),
                       trusted_relays="token:router") as v, \
            router_for(v, auth_tokens=str(tmp_path / "router"), verifier_auth_token="r-t0k") as router:
        alice = RemoteVerifier(router.target, ChannelConfig(auth_token="a-t0k"))
        held = [alice.open(PROMPT, GREEDY, client_id=f"made-up-{i}") for i in range(2)]
        for h in held:
            h.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:
            alice.open(PROMPT, GREEDY, client_id="made-up-2").step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'token:alice' already has 2 open sessions" in err.value.details()
        bob = RemoteVerifier(router.target, ChannelConfig(auth_token="b-t0k")).open(PROMPT, GREEDY)
        bob.step(DraftTree.empty())
        for h in held + [bob]:
            h.close()
        assert v.used_blocks() == 0


def test_the_routers_per_client_limits_count_sessions_and_tokens_across_all_its_verifiers():
    """Each verifier counts only its own sessions, so a client behind a router could open each one's limit
    once per verifier; the router's own limits count everything it relays for the client."""
    with tiny_verifier() as a, tiny_verifier() as b, \
            router_for(a, b, policy="round-robin", max_sessions_per_client=2) as router:
        client = RemoteVerifier(router.target)
        held = [client.open(PROMPT, GREEDY) for _ in range(2)]
        for h in held:
            h.step(DraftTree.empty())
        assert len(a.service.sessions_by_client) == len(b.service.sessions_by_client) == 1  # one on each
        for refused in (lambda: client.open(PROMPT, GREEDY).step(DraftTree.empty()),
                        lambda: list(client.server_generate(PROMPT, GREEDY))):
            with pytest.raises(grpc.RpcError) as err:
                refused()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'peer:ipv4:127.0.0.1' already has 2 open sessions" in err.value.details()
        held.pop().close()
        wait_for(lambda: router.call(lambda: router.running.service.limits.open_sessions) == 1, "the relay to end")
        assert len(generate(client.open(PROMPT, GREEDY)).token_ids) == GREEDY.max_new_tokens
        held[0].close()
    claim = len(PROMPT) + GREEDY.max_new_tokens
    with tiny_verifier() as a, router_for(a, max_tokens_per_client=2 * claim - 1) as router:
        client = RemoteVerifier(router.target)
        held = client.open(PROMPT, GREEDY)
        held.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:
            client.open(PROMPT, GREEDY).step(DraftTree.empty())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"claiming {claim} tokens; this one (prompt + max_new_tokens = {claim})" in err.value.details()
        held.close()


def test_a_client_cannot_claim_an_identity_where_it_is_not_a_trusted_relay(tmp_path):
    (tmp_path / "tokens").write_text("mallory m-t0k\nrouter r-t0k\n")
    with tiny_verifier(max_sessions_per_client=1, auth_tokens=str(tmp_path / "tokens"),
                       trusted_relays="token:router") as v:
        held = RemoteVerifier(v.target, ChannelConfig(auth_token="m-t0k")).open(PROMPT, GREEDY)
        held.step(DraftTree.empty())
        with pytest.raises(grpc.RpcError) as err:
            open_raw(v, opening(), metadata=(("authorization", "Bearer m-t0k"), (CLIENT_IDENTITY, "token:victim")))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'token:mallory' already has 1 open sessions" in err.value.details()
        held.close()
        assert v.used_blocks() == 0
