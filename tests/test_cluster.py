"""The cluster as it is deployed, in real processes on 127.0.0.1 with the real default model: `specedge
router` and `specedge serve --register` verifiers. Verifiers SIGKILLed twice and the router restarted in
the middle of generations change neither greedy nor seeded-sampling output; a client given two routers
survives losing one; SIGTERM on a registered verifier moves its live session with no client error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specedge.cloud.launch import ServiceProcess, VerifierProcess
from specedge.edge.client import EdgeClient

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
