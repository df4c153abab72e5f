"""The cluster as it is deployed, in real processes on 127.0.0.1 with the real default model: `specedge
router` and `specedge serve --register` verifiers. Verifiers SIGKILLed twice and the router restarted in
the middle of generations change neither greedy nor seeded-sampling output; a client given two routers
survives losing one; SIGTERM on a registered verifier moves its live session with no client error; the
router places by the caches the verifier processes report."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specedge.cloud.launch import ServiceProcess, VerifierProcess
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.client import EdgeClient
from specedge.edge.generation import generate
from specedge.edge.transport import RemoteVerifier
from specedge.protos import router_pb2 as rpb

pytestmark = pytest.mark.real_model
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the storm, "
          "the bottle, and what the message says.")
GREEDY = dict(max_new_tokens=96)
SEEDED = dict(max_new_tokens=96, temperature=0.8, top_p=0.95, seed=1234)


def verifiers(router: ServiceProcess, n: int) -> list[VerifierProcess]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: VerifierProcess("--kv-pool-mb", "64", "--register", router.target), range(n)))


def holder(fleet: list[VerifierProcess]) -> VerifierProcess:
    """The verifier the session is on now."""
    return next(v for v in fleet if v.alive and v.metric("specedge_sessions_active") > 0)


@pytest.fixture(scope="module")
def cluster():
    with ServiceProcess("router") as router:
        fleet = verifiers(router, 3)
        try:
            yield router, fleet
        finally:
            for v in fleet:
                v.stop(grace_s=5)


def whole(cluster) -> tuple[ServiceProcess, list[VerifierProcess]]:
    """The module's cluster with every verifier (re)started and in the router's pool."""
    router, fleet = cluster
    for v in fleet:
        if not v.alive:
            v.start()
    await_fleet(router, len(fleet))
    return router, fleet


def idle(fleet: list[VerifierProcess]) -> None:
    """Wait until no verifier holds a session (a finished one is released a moment after its last reply), so
    that `holder` finds the session of the generation that follows."""
    deadline = time.monotonic() + 30
    while any(v.alive and v.metric("specedge_sessions_active") > 0 for v in fleet):
        assert time.monotonic() < deadline, "a finished session was never released"
        time.sleep(0.05)


def await_fleet(router: ServiceProcess, n: int) -> None:
    deadline = time.monotonic() + 30
    while router.metric('specedge_router_verifiers{state="in_pool"}') < n:
        assert time.monotonic() < deadline, "the verifiers did not all join the router"
        time.sleep(0.2)


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_two_verifier_kills_and_a_router_restart_change_no_output(cluster, settings):
    router, fleet = whole(cluster)
    client = EdgeClient(router.target, drafter="retrieval")
    want = client.generate(PROMPT, chat=True, **settings)
    assert want.resumes == 0
    idle(fleet)

    produced, faults = [0], []

    def inject_faults(tokens: list[int]) -> None:  # on the client's thread, between rounds
        produced[0] += len(tokens)
        if produced[0] >= 16 and len(faults) == 0 or produced[0] >= 40 and len(faults) == 1:
            holder(fleet).kill()  # SIGKILL the verifier the session is on
            faults.append("verifier")
        elif produced[0] >= 64 and len(faults) == 2:
            router.kill()
            threading.Thread(target=router.start).start()  # back on the same port while the client retries
            faults.append("router")

    got = client.generate(PROMPT, chat=True, on_tokens=inject_faults, **settings)
    assert faults == ["verifier", "verifier", "router"]
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.resumes == 3
    client.close()


def test_a_client_given_two_routers_survives_losing_one():
    with ServiceProcess("router") as first, ServiceProcess("router") as second, \
            VerifierProcess("--kv-pool-mb", "64") as v:
        for router in (first, second):
            router.stop()
            router._argv += ["--verifiers", v.target]
            router.start()
        client = EdgeClient([first.target, second.target])
        want = client.generate(PROMPT, chat=True, **GREEDY)
        cut = [False]

        def lose_the_first_router(tokens: list[int]) -> None:
            if not cut[0]:
                cut[0] = True
                first.kill()

        got = client.generate(PROMPT, chat=True, on_tokens=lose_the_first_router, **GREEDY)
        assert got.token_ids == want.token_ids and got.resumes == 1
        client.close()


def test_sigterm_on_a_registered_verifier_moves_its_live_session(cluster):
    router, fleet = whole(cluster)
    client = EdgeClient(router.target, drafter="retrieval")
    want = client.generate(PROMPT, chat=True, **GREEDY)
    idle(fleet)
    moved = []

    def terminate_the_holder(tokens: list[int]) -> None:
        if not moved:
            victim = holder(fleet)
            moved.append(victim)
            threading.Thread(target=victim.stop).start()  # SIGTERM: leave the router, migrate, exit

    got = client.generate(PROMPT, chat=True, on_tokens=terminate_the_holder, **GREEDY)
    assert got.token_ids == want.token_ids and got.resumes == 1
    moved[0].stop()
    assert not moved[0].alive
    assert '"event": "drain"' in moved[0].output()


def sessions_opened(v: VerifierProcess) -> float:
    try:
        return v.metric('specedge_sessions_total{rpc="Session"}')
    except KeyError:  # none yet: the labelled series appears with the first
        return 0.0


def ask(target: str, prompt: list[int]) -> None:
    generate(RemoteVerifier(target).open(prompt, SamplingParams(max_new_tokens=4)))


def went_to(fleet: list[VerifierProcess], target: str, prompt: list[int]) -> list[VerifierProcess]:
    """The verifiers that opened a session for `prompt` sent to `target`."""
    before = [sessions_opened(v) for v in fleet]
    ask(target, prompt)
    return [v for v, n in zip(fleet, before) if sessions_opened(v) > n]


def explain(router: ServiceProcess, prompt: list[int]) -> rpb.Explanation:
    with grpc.insecure_channel(router.target) as channel:
        call = channel.unary_unary("/specedge.v1.Router/Explain",
                                   request_serializer=rpb.ExplainRequest.SerializeToString,
                                   response_deserializer=rpb.Explanation.FromString)
        return call(rpb.ExplainRequest(prompt_ids=prompt), timeout=10)


def router_sees(router: ServiceProcess, prompt: list[int], condition, what: str) -> None:
    """Wait until the router's view of `prompt` (its Explain dry run) satisfies `condition`: the verifiers'
    reports reach it within a few hundred ms."""
    deadline = time.monotonic() + 30
    while not condition({c.address: c for c in explain(router, prompt).candidates}):
        assert time.monotonic() < deadline, f"the router never saw {what}"
        time.sleep(0.05)


def test_affinity_across_processes_follows_the_reported_caches(cluster):
    """Verifier processes report their caches to the router process: the same document goes to the verifier
    that holds it; once it is evicted there and held elsewhere, it goes there; a saturated holder loses it
    while another holder keeps its own document's sessions."""
    router, fleet = whole(cluster)
    idle(fleet)
    doc_a = [(37 * i) % 30000 + 1000 for i in range(320)]  # 20 blocks
    doc_b = [(53 * i) % 30000 + 2000 for i in range(320)]
    (x,) = went_to(fleet, router.target, doc_a + [5, 6])
    assert went_to(fleet, router.target, doc_a + [7, 8]) == [x]

    y = next(v for v in fleet if v is not x)
    for filler in range(3):  # other long prompts straight to x push the document out of its 64 MiB pool
        ask(x.target, [(71 * i + filler) % 30000 + 3000 for i in range(900)])
    ask(y.target, doc_a + [9])  # and y takes it
    router_sees(router, doc_a + [10, 11], lambda c: c[x.target].cached_tokens == 0 and c[y.target].cached_tokens >= 304,
                "the eviction on x and the document on y")
    assert went_to(fleet, router.target, doc_a + [10, 11]) == [y]

    ask(x.target, doc_b + [9])  # x holds document B ...
    held = [RemoteVerifier(y.target).open([3, 4, 5, 6], SamplingParams(max_new_tokens=200)) for _ in range(6)]
    for session in held:  # ... and y, holding A, is saturated (6 sessions, threshold 4)
        session.step(DraftTree.empty())
    router_sees(router, doc_b + [12, 13], lambda c: c[y.target].load >= 6 and c[x.target].cached_tokens >= 304,
                "y's load and B on x")
    assert went_to(fleet, router.target, doc_a + [12, 13]) != [y]  # A leaves its busy holder
    assert went_to(fleet, router.target, doc_b + [12, 13]) == [x]  # B's affinity holds
    for session in held:
        session.close()
