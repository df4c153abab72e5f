"""Soak: 64 clients at once, for SOAK_S seconds (120 in CI; longer runs are recorded in RELIABILITY.md), on
a verifier whose KV pool holds at most a quarter of them (tiny model, real gRPC on 127.0.0.1). Clients draft
well, badly or not at all; a session the pool cannot take now is told when to come back and resumes
(edge/resume.py). Every session must end with its solo greedy output, none may fail, the pool stays
within its budget, no thread outlives its session, and Python's allocated memory does not grow with the
sessions served after each client's first (the process's RSS is reported, not asserted: see RELIABILITY.md);
each session's latency is recorded (p50/p99 printed, and written to SOAK_REPORT as JSON when that is set)."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import threading
import time

from test_grpc import V, chain_drafts, healthy, solo_output, tiny_verifier

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableSession
from specedge.edge.transport import RemoteVerifier

SOAK_S = float(os.environ.get("SOAK_S", 120))
CLIENTS = 64
PARAMS = SamplingParams(max_new_tokens=64)
# Python's allocated memory blocks after the last session, over those after every client's first. (Counted
# with sys.getallocatedblocks: gc.get_objects() from this thread can take hold of a tuple that another thread
# is still building, and CPython's tuple resize then fails there with SystemError.)
BLOCK_GROWTH = 200_000


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_64_clients_on_a_pool_too_small_for_them_all_get_their_solo_outputs():
    with tiny_verifier(kv_pool_mb=1, max_sessions_per_client=CLIENTS) as s:
        pool = s.engine.pool
        prompts = [[(13 * i + j) % V for j in range(64 + 5 * i)] for i in range(8)]
        want = [solo_output(s, p, PARAMS) for p in prompts]
        blocks_wanted = sum(math.ceil((len(prompts[i % 8]) + PARAMS.max_new_tokens) / pool.block_size)
                            for i in range(CLIENTS))
        assert blocks_wanted > 4 * pool.num_blocks  # holds a quarter of them at most
        latencies: list[list[float]] = [[] for _ in range(CLIENTS)]
        wrong: list[tuple[int, int]] = []
        errors: list[str] = []
        verifier = RemoteVerifier(s.target)  # one channel for all, as one edge process would have
        threads_before = threading.active_count()
        deadline = time.monotonic() + SOAK_S

        def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                p = rng.randrange(len(prompts))
                kind = rng.random()
                if kind < 0.6:  # the true continuation, some tokens deep
                    drafter = FunctionDrafter(chain_drafts(prompts[p] + want[p], depth=rng.randint(1, 8)))
                elif kind < 0.8:  # wrong guesses
                    drafter = FunctionDrafter(lambda c, rng=random.Random(rng.random()):
                                              DraftTree.chain([rng.randrange(V) for _ in range(3)]))
                else:
                    drafter = None
                start = time.monotonic()
                try:
                    session = ResumableSession(lambda: verifier, prompts[p], PARAMS, f"soak-{i}", "")
                    got = generate(session, drafter=drafter).token_ids
                except Exception as e:  # reported below: no session may fail
                    errors.append(f"client {i}: {e!r}")
                    return
                latencies[i].append(time.monotonic() - start)
                if got != want[p]:
                    wrong.append((i, p))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        peak_used, rss_warm, blocks_warm = 0, None, None
        while any(t.is_alive() for t in threads):
            peak_used = max(peak_used, pool.stats().used)
            if rss_warm is None and all(latencies):  # every client has its threads' and channels' memory
                gc.collect()
                rss_warm, blocks_warm = rss_mb(), sys.getallocatedblocks()
            time.sleep(0.05)
        gc.collect()
        rss_growth = rss_mb() - (rss_warm or rss_mb())
        block_growth = sys.getallocatedblocks() - (blocks_warm or sys.getallocatedblocks())
        all_latencies = [x for per_client in latencies for x in per_client]
        report = {"clients": CLIENTS, "seconds": SOAK_S, "sessions": len(all_latencies), "failed": len(errors),
                  "wrong_outputs": len(wrong), "kv_blocks": pool.num_blocks, "kv_peak_used": peak_used,
                  "p50_s": round(percentile(all_latencies, 0.5), 3), "p99_s": round(percentile(all_latencies, 0.99), 3),
                  "rss_growth_after_first_sessions_mb": round(rss_growth, 1),
                  "python_blocks_growth_after_first_sessions": block_growth}
        print("soak:", json.dumps(report))
        if os.environ.get("SOAK_REPORT"):
            with open(os.environ["SOAK_REPORT"], "w") as f:
                json.dump(report, f)
        assert not errors, errors[:3]
        assert not wrong, wrong[:5]
        assert all(latencies), "every client finished sessions"
        assert peak_used <= pool.num_blocks and pool.peak_used <= pool.num_blocks
        assert block_growth < BLOCK_GROWTH, report
        deadline = time.monotonic() + 10  # gRPC's sending threads notice their call's end within a second
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= threads_before, [t.name for t in threading.enumerate()]
        assert s.used_blocks() == 0
        assert healthy(s)


def test_a_client_that_stops_reading_does_not_stall_the_others():
    """A client pipelines 2,000 drafts and reads none of the verdicts: they pile up (in gRPC's buffers, then
    its flow control holds the stream's handler), but the engine goes on for everyone else. Afterwards it
    reads every verdict, and its output is still exactly its solo output. (The honest client's time with
    and without it is printed, for RELIABILITY.md; timings are not asserted.)"""
    import grpc

    from specedge.common import wire
    from specedge.protos import verifier_pb2 as pb

    rounds = 2000
    with tiny_verifier(max_new_tokens=4096) as s:
        slow_prompt, params = [5, 6, 7, 8] * 6, SamplingParams(max_new_tokens=rounds + 1)
        want_slow = solo_output(s, slow_prompt, params)
        honest_prompt = [9, 10, 11] * 8
        want = solo_output(s, honest_prompt, PARAMS)
        start = time.monotonic()
        for _ in range(5):
            solo_output(s, honest_prompt, PARAMS)
        alone_s = time.monotonic() - start
        messages = [pb.SessionRequest(open=pb.OpenSession(prompt_ids=slow_prompt, params=wire.params_to_pb(params)))]
        messages += [pb.SessionRequest(draft=pb.DraftTree())] * rounds  # one token a round
        with grpc.insecure_channel(s.target) as channel:
            call = channel.stream_stream("/specedge.v1.Verifier/Session",
                                         request_serializer=pb.SessionRequest.SerializeToString,
                                         response_deserializer=pb.SessionResponse.FromString)
            replies = call(iter(messages + [pb.SessionRequest(close=pb.CloseSession())]), timeout=120)
            served = []
            start = time.monotonic()
            for _ in range(5):  # meanwhile: the slow client's verdicts pile up unread
                served.append(solo_output(s, honest_prompt, PARAMS))
            honest_s = time.monotonic() - start
            got = []
            for reply in replies:  # now it reads
                verdict = reply.opened.verdict if reply.WhichOneof("kind") == "opened" else reply.verdict
                got += verdict.tokens
        print(f"slow client: 5 honest generations in {honest_s:.2f} s while {rounds} verdicts waited unread, "
              f"{alone_s:.2f} s alone")
        assert served == [want] * 5
        assert got == want_slow
        assert s.used_blocks() == 0
