"""Run many generations on one engine in lockstep: each on its own thread, their steps batched into one pass.

A round waits until every generation still running has handed in its step, then one engine pass verifies
them all, in the generations' order, so a run is the same every time. The passes run on the caller's
thread (the one that loaded the model: OpenMP threads stay warm there). A batched pass is what a served
verifier does; it also reads the weights once for all the generations, which is why tests use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from specedge.cloud.engine import Engine

T = TypeVar("T")


class _Rounds:
    def __init__(self, engine: Engine, live: int) -> None:
        self.engine, self.live = engine, live
        self.changed = threading.Condition()
        self.pending: dict[int, list] = {}
        self.verdicts: dict[int, list] = {}
        self.failed: BaseException | None = None

    def submit(self, member: int, work: list) -> list:
        with self.changed:
            self.pending[member] = work
            self.changed.notify_all()
            self.changed.wait_for(lambda: member in self.verdicts or self.failed)
            if self.failed:
                raise RuntimeError("the lockstep pass failed") from self.failed
            return self.verdicts.pop(member)

    def call(self, method: str, *args):
        """Any other engine call, never during a pass or another call (the KV pool has one owner at a time)."""
        with self.changed:
            return getattr(self.engine, method)(*args)

    def leave(self) -> None:
        with self.changed:
            self.live -= 1
            self.changed.notify_all()

    def run(self) -> None:
        """Step until every generation has left."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: len(self.pending) == self.live)
                if not self.live:
                    return
                members = sorted(self.pending)
                try:
                    verdicts = self.engine.step([item for m in members for item in self.pending[m]])
                except BaseException as e:
                    self.failed = e
                    self.changed.notify_all()
                    raise
                for m in members:
                    self.verdicts[m], verdicts = verdicts[: len(self.pending[m])], verdicts[len(self.pending[m]):]
                self.pending.clear()
                self.changed.notify_all()


class _MemberEngine:
    """The engine as one generation sees it: its steps go through the rounds; the rest is the engine's."""

    def __init__(self, rounds: _Rounds, member: int) -> None:
        self._rounds, self._member = rounds, member

    def step(self, work: list) -> list:
        return self._rounds.submit(self._member, work)

    def add_sequence(self, *args):
        return self._rounds.call("add_sequence", *args)

    def release(self, seq) -> None:
        self._rounds.call("release", seq)

    def __getattr__(self, name: str):
        return getattr(self._rounds.engine, name)


def run_in_lockstep(engine: Engine, jobs: list[Callable[[Engine], T]]) -> list[T]:
    """Each job called with its view of `engine` on its own thread; their results in order. A job that
    raises has its exception raised here, after the others have finished."""
    rounds = _Rounds(engine, len(jobs))
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def member(i: int) -> None:
        try:
            results[i] = jobs[i](_MemberEngine(rounds, i))
        except BaseException as e:  # raised on the caller's thread below
            errors.append(e)
        finally:
            rounds.leave()

    threads = [threading.Thread(target=member, args=(i,), name=f"lockstep-{i}") for i in range(len(jobs))]
    for t in threads:
        t.start()
    try:
        rounds.run()
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return results
