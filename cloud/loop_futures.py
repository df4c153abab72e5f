"""The scheduler's answers handed to the server's event loop, a step's in one wake-up.

`asyncio.wrap_future` makes each answer wake the loop on its own: a write to the loop's self-pipe from the
scheduler's thread, where the loop's thread also takes the GIL from it, runs what the answer wakes and only
then gives it back. A step that answered sixteen sessions did that up to sixteen times. Here the answers
given inside `answering()` (the scheduler gives a step's that way) are handed over together when it ends;
one given outside it is handed over at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager


class LoopFutures:
    """`wrap(future)`: an asyncio future of `loop` with `future`'s outcome (cancelling it cancels `future`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[asyncio.Future, Future]] = []  # answered, not yet handed over
        self._holding = 0  # answering() blocks under way
        self._scheduled = False  # a hand-over is on the loop's way

    def wrap(self, future: Future) -> asyncio.Future:
        waiter = self._loop.create_future()
        waiter.add_done_callback(lambda w: future.cancel() if w.cancelled() else None)
        future.add_done_callback(lambda f: self._answered(waiter, f))
        return waiter

    @contextmanager
    def answering(self) -> Iterator[None]:
        """Answers given inside are handed over together, when the block ends."""
        with self._lock:
            self._holding += 1
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1
                schedule = self._should_schedule()
            if schedule:
                self._schedule()

    def _should_schedule(self) -> bool:  # under the lock
        if self._holding or self._scheduled or not self._ready:
            return False
        self._scheduled = True
        return True

    def _schedule(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is closed: the server has stopped and nobody waits
            pass

    def _answered(self, waiter: asyncio.Future, future: Future) -> None:  # on whichever thread answered
        with self._lock:
            self._ready.append((waiter, future))
            schedule = self._should_schedule()
        if schedule:
            self._schedule()

    def _hand_over(self) -> None:
        with self._lock:
            ready, self._ready, self._scheduled = self._ready, [], False
        for waiter, future in ready:
            if waiter.done():  # cancelled meanwhile
                continue
            if future.cancelled():
                waiter.cancel()
            elif (error := future.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())
