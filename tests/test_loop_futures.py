"""cloud/loop_futures.py: the scheduler's answers reach the server's event loop with their outcome (result,
error, cancellation, both ways), and a step's many answers cost the loop one wake-up, not one each."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from specedge.cloud.loop_futures import LoopFutures


def test_every_outcome_arrives_and_a_cancelled_waiter_cancels_the_schedulers_future():
    async def main():
        futures = LoopFutures(asyncio.get_running_loop())
        answered, failed, dropped, abandoned = Future(), Future(), Future(), Future()
        waiters = [futures.wrap(f) for f in (answered, failed, dropped, abandoned)]
        waiters[3].cancel()  # the handler stops waiting (a drain, a client gone): the request is cancelled
        await asyncio.sleep(0)
        assert abandoned.cancelled()
        threading.Thread(target=lambda: (answered.set_result(7), failed.set_exception(ValueError("no")),
                                         dropped.cancel())).start()
        assert await waiters[0] == 7
        with pytest.raises(ValueError, match="no"):
            await waiters[1]
        with pytest.raises(asyncio.CancelledError):
            await waiters[2]
        done = Future()
        done.set_result("already")  # answered before it was wrapped
        assert await futures.wrap(done) == "already"

    asyncio.run(main())


def counting_wake_ups(loop: asyncio.AbstractEventLoop) -> list:
    wake_ups = []
    call_soon_threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a, **k: (wake_ups.append(a), call_soon_threadsafe(*a, **k))[1]
    return wake_ups


def test_a_steps_answers_given_inside_answering_wake_the_loop_once_though_it_is_free_to_run():
    async def main():
        futures = LoopFutures(asyncio.get_running_loop())
        wake_ups = counting_wake_ups(asyncio.get_running_loop())
        answers = [Future() for _ in range(16)]
        waiters = [futures.wrap(f) for f in answers]

        def step() -> None:
            with futures.answering():
                for i, f in enumerate(answers):
                    f.set_result(i)
                    time.sleep(0.001)  # the loop could run in between: nothing wakes it

        stepper = threading.Thread(target=step)
        stepper.start()
        assert await asyncio.gather(*waiters) == list(range(16))
        stepper.join()
        assert len(wake_ups) == 1

    asyncio.run(main())


def test_answers_given_while_the_loop_is_busy_wake_it_once():
    async def main():
        futures = LoopFutures(asyncio.get_running_loop())
        wake_ups = counting_wake_ups(asyncio.get_running_loop())
        answers = [Future() for _ in range(16)]
        waiters = [futures.wrap(f) for f in answers]
        stepper = threading.Thread(target=lambda: [f.set_result(i) for i, f in enumerate(answers)])
        stepper.start()
        stepper.join()  # the loop is blocked meanwhile: the first answer's hand-over takes them all
        assert await asyncio.gather(*waiters) == list(range(16))
        assert len(wake_ups) == 1

    asyncio.run(main())


def test_answers_after_the_loop_has_closed_are_dropped_quietly():
    loop = asyncio.new_event_loop()
    futures = LoopFutures(loop)
    answer = Future()
    futures.wrap(answer)
    loop.close()  # the server stopped while a step was under way
    with futures.answering():
        answer.set_result(1)  # nobody waits: no error reaches the scheduler
