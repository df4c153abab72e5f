"""Chaos: clients generate through a faulty network proxy and a router to two verifiers (tiny model, real
gRPC on 127.0.0.1) while, every couple of seconds, a verifier is killed and started again on its port, or
the router (a process of its own) is SIGKILLed and started again on its port, and other clients vanish
mid-session without a goodbye. For CHAOS_S seconds (40 in CI; longer runs are recorded in RELIABILITY.md).

Nothing may be lost or duplicated: every generation ends (resuming across each break, edge/resume.py)
with exactly its solo greedy output, none waits for ever. Every verifier ends with no KV block in use.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import grpc
import pytest
from test_grpc import V, chain_drafts, solo_output, tiny_verifier
from test_router import wait_for

from specedge.cloud.launch import EmbeddedVerifier
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.ports import free_port
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableSession
from specedge.edge.transport import RemoteVerifier
from specedge.netem.proxy import EmbeddedProxy, NetworkConditions
from specedge.protos import router_pb2 as rpb

CHAOS_S = float(os.environ.get("CHAOS_S", 40))
CLIENTS = 6
PARAMS = SamplingParams(max_new_tokens=40)
FAULT_EVERY_S = (1.5, 3.0)
NETWORK = NetworkConditions(reset_probability=0.01, stall_probability=0.02, stall_ms=200, seed=14)


def verifier_on(port: int) -> EmbeddedVerifier:
    """A verifier on `port`: the tiny model's weights are seeded, so a restarted one is the same model."""
    return tiny_verifier(port=port, grace_s=0)


class RouterProcess:
    """`specedge router` in a process of its own, so that killing it is a SIGKILL: its sockets close as a
    crashed router's do. (An in-process router stopped and replaced on the same port left its accepted
    connections open with nobody serving them, which no real crash does.)"""

    def __init__(self, port: int, verifiers: list[EmbeddedVerifier]) -> None:
        script = Path(sys.executable).with_name("specedge")
        self.target = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(script), "router", "--port", str(port), "--health-interval-s", "0.2",
                                      "--health-timeout-s", "0.5",
                                      "--verifiers", ",".join(v.target for v in verifiers)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: len(self.serving_verifiers()) == len(verifiers), "the router to serve", timeout_s=60)

    def serving_verifiers(self) -> list[str]:
        assert self.proc.poll() is None, "the router exited"
        try:
            with grpc.insecure_channel(self.target) as channel:
                reply = channel.unary_unary("/specedge.v1.Router/ListVerifiers",
                                            request_serializer=rpb.ListVerifiersRequest.SerializeToString,
                                            response_deserializer=rpb.VerifierList.FromString)(
                    rpb.ListVerifiersRequest(), timeout=2)
        except grpc.RpcError:
            return []
        return [v.address for v in reply.verifiers if v.healthy and not v.draining]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


class Cluster:
    """Two verifiers behind a router behind the proxy; kills and restarts any of them in place."""

    def __init__(self) -> None:
        self.ports = [free_port(), free_port()]  # not port 0's: they are restarted in place (common/ports.py)
        self.verifiers = [verifier_on(port) for port in self.ports]
        self.router_port = free_port()
        self.router = RouterProcess(self.router_port, self.verifiers)
        self.proxy = EmbeddedProxy(self.router.target, NETWORK)
        self.target = self.proxy.target
        self.faults: dict[str, int] = {"verifier killed": 0, "router killed": 0}

    def kill_a_verifier(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.verifiers))
        self.verifiers[i].kill()
        self.verifiers[i].stop(grace_s=0)
        self.faults["verifier killed"] += 1
        time.sleep(rng.uniform(0.1, 0.8))
        self.verifiers[i] = verifier_on(self.ports[i])

    def kill_the_router(self, rng: random.Random) -> None:
        self.router.kill()
        self.faults["router killed"] += 1
        time.sleep(rng.uniform(0.1, 0.5))
        self.router = RouterProcess(self.router_port, self.verifiers)

    def stop(self) -> None:
        self.proxy.stop()
        self.router.kill()
        for v in self.verifiers:
            v.stop(grace_s=0)


def test_nothing_is_lost_or_duplicated_while_verifiers_and_the_router_die_and_clients_vanish():
    cluster = Cluster()
    try:
        prompts = [[(17 * i + j) % V for j in range(20 + 4 * i)] for i in range(4)]
        want = [solo_output(cluster.verifiers[0], p, PARAMS) for p in prompts]
        deadline = time.monotonic() + CHAOS_S
        done = [0] * CLIENTS
        resumes = [0] * CLIENTS
        wrong: list = []
        errors: list[str] = []
        vanished = [0]

        def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                p = rng.randrange(len(prompts))
                drafter = FunctionDrafter(chain_drafts(prompts[p] + want[p], depth=rng.randint(0, 6)))
                try:
                    session = ResumableSession(lambda: RemoteVerifier(cluster.target), prompts[p], PARAMS,
                                               f"chaos-{i}", "", retries=20)
                    got = generate(session, drafter=drafter).token_ids
                except Exception as e:  # reported below: every generation must end well
                    errors.append(f"client {i}: {e!r}")
                    return
                done[i] += 1
                resumes[i] += session.resumes
                if got != want[p]:
                    wrong.append((i, p, got))

        def vanishing_client() -> None:
            rng = random.Random(99)
            while time.monotonic() < deadline:
                verifier = None
                try:
                    verifier = RemoteVerifier(cluster.target)
                    session = verifier.open(prompts[rng.randrange(len(prompts))], PARAMS)
                    for _ in range(rng.randint(1, 4)):
                        session.step(DraftTree.chain([rng.randrange(V)]))
                    vanished[0] += 1
                except Exception:  # the cluster is mid-fault: this client only ever leaves anyway
                    pass
                finally:
                    if verifier is not None:
                        verifier.channel.close()  # gone, without closing its session
                time.sleep(rng.uniform(0.05, 0.3))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        threads.append(threading.Thread(target=vanishing_client))
        for t in threads:
            t.start()
        rng = random.Random(7)
        while time.monotonic() < deadline - 2:
            time.sleep(rng.uniform(*FAULT_EVERY_S))
            if rng.random() < 0.7:
                cluster.kill_a_verifier(rng)
            else:
                cluster.kill_the_router(rng)
        stuck = _join(threads, timeout_s=60)  # a generation that cannot end is a failure, not a hang
        if stuck:
            state = {"verifier sessions": [dict(v.service.sessions_by_client) for v in cluster.verifiers],
                     "verifier waiting": [v.service.scheduler.waiting_requests for v in cluster.verifiers]}
            pytest.fail(f"{len(stuck)} threads still running 60 s after the end ({state}):\n\n"
                        + "\n\n".join(stuck[:1]))
        report = {"seconds": CHAOS_S, "clients": CLIENTS, "generations": sum(done), "resumes": sum(resumes),
                  "vanished_clients": vanished[0], "proxy_resets": cluster.proxy.proxy.resets,
                  "failed": len(errors), "wrong_outputs": len(wrong), **cluster.faults}
        print("chaos:", json.dumps(report))
        if os.environ.get("CHAOS_REPORT"):
            with open(os.environ["CHAOS_REPORT"], "w") as f:
                json.dump(report, f)
        assert not errors, errors[:3]
        assert not wrong, wrong[:3]
        assert all(done), done
        assert sum(resumes) > 0 and cluster.faults["verifier killed"] and cluster.faults["router killed"]
        for v in cluster.verifiers:
            assert v.used_blocks() == 0
    finally:
        cluster.stop()


def _join(threads: list[threading.Thread], timeout_s: float) -> list[str]:
    """Join `threads`; the stacks of those still running after `timeout_s` (all of them together)."""
    end = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    frames = sys._current_frames()
    return ["".join(traceback.format_stack(frames[t.ident])) for t in threads if t.is_alive() and t.ident in frames]
