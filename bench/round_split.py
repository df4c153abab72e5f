"""Where a served round's time goes besides the engine's pass: one client on loopback gRPC, greedy rounds of
empty trees against a verifier embedded in this process, each leg timed by one clock (BENCHMARKS.md section 9).

    .venv/bin/python bench/round_split.py --model smollm2-135m --rounds 150

Legs (medians over the rounds after the first 20): the client's send until the server has parsed the tree;
until the scheduler has the request; until the engine's step starts (the scheduler's wait); the step; from the
step's end until the server has built the verdict; until the client has it. The marks are set by wrapping the
service's and scheduler's own methods, so what this measures is the served path itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.transport import RemoteVerifier

LEGS = ("send -> parsed", "parsed -> submitted", "submitted -> step", "step", "step -> verdict built",
        "verdict built -> client")


def timed(marks: list[float], fn):
    def wrapper(*args, **kwargs):
        marks.append(time.perf_counter())
        return fn(*args, **kwargs)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    prompt = list(range(100, 164))
    with EmbeddedVerifier(ServerConfig(model=args.model, port=0, max_new_tokens=args.rounds + 8)) as verifier:
        service, scheduler = verifier.service, verifier.service.scheduler
        engine = scheduler.engine
        marks: dict[str, list[float]] = defaultdict(list)
        service._tree = timed(marks["parsed"], service._tree)  # every tree, the open's included
        scheduler.verify = timed(marks["submitted"], scheduler.verify)  # every tree but the open's
        service._verdict = timed(marks["verdict built"], service._verdict)
        step = engine.step

        def timed_step(*a, **k):
            marks["step"].append(time.perf_counter())
            try:
                return step(*a, **k)
            finally:
                marks["step end"].append(time.perf_counter())

        engine.step = timed_step
        for rep in range(args.reps):
            for m in marks.values():
                m.clear()
            session = RemoteVerifier(verifier.target).open(prompt, SamplingParams(max_new_tokens=args.rounds + 4))
            sent, got = [], []
            for _ in range(args.rounds):
                sent.append(time.perf_counter())
                session.step(DraftTree.empty())
                got.append(time.perf_counter())
            session.close()
            legs = defaultdict(list)
            for i in range(20, args.rounds):  # round i: the i-th tree (0: the open's)
                at = [sent[i], marks["parsed"][i], marks["submitted"][i - 1], marks["step"][i], marks["step end"][i],
                      marks["verdict built"][i], got[i]]
                for leg, (a, b) in zip(LEGS, zip(at, at[1:])):
                    legs[leg].append((b - a) * 1e3)
                legs["round"].append((got[i] - sent[i]) * 1e3)
            print(f"rep {rep}: " + ", ".join(f"{leg} {statistics.median(v):.2f}" for leg, v in legs.items()) + " ms")


if __name__ == "__main__":
    main()
