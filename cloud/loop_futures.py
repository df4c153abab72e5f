"""The scheduler's answers handed to the server's event loop, many to one wake-up.

`asyncio.wrap_future` makes each answer wake the loop on its own: a write to the loop's self-pipe from the
scheduler's thread, which also lets the loop's thread take the GIL from it mid-step. A step that answers
sixteen sessions did that sixteen times. Here the first answer of a step schedules one hand-over and the
others join it while it has not yet run."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future


class LoopFutures:
    """`wrap(future)`: an asyncio future of `loop` with `future`'s outcome (cancelling it cancels `future`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[tuple[asyncio.Future, Future]] = []  # answered, not yet handed over

    def wrap(self, future: Future) -> asyncio.Future:
        waiter = self._loop.create_future()
        waiter.add_done_callback(lambda w: future.cancel() if w.cancelled() else None)
        future.add_done_callback(lambda f: self._answered(waiter, f))
        return waiter

    def _answered(self, waiter: asyncio.Future, future: Future) -> None:  # on whichever thread answered
        if self._loop.is_closed():  # the server has stopped: nobody waits
            return
        with self._lock:
            self._ready.append((waiter, future))
            first = len(self._ready) == 1
        if first:
            self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for waiter, future in ready:
            if waiter.done():  # cancelled meanwhile
                continue
            if future.cancelled():
                waiter.cancel()
            elif (error := future.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())
