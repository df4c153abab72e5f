"""One generation read as it happens: text pieces as tokens are committed, then the whole result.

The generation runs in a worker thread (drafting and waiting on the verifier are blocking work); its
pieces cross to the reader through a queue, a plain one or an asyncio one. A reader that stops reading
(closes the iterator, a web client that hangs up) ends the generation at its next round, which closes the
verifier's session and frees its KV blocks, instead of generating on for nobody.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from specedge.edge.text_stream import TextStream

_DONE = object()


class StreamClosed(Exception):
    """Raised inside the generation loop once its reader has gone."""


def _start(client, prompt, kwargs: dict, put: Callable[[object], None], closed: threading.Event) -> None:
    """Run `client.generate` in a thread, `put`ting text pieces, then its ClientResult, then _DONE (or the
    exception it raised). Setting `closed` stops it at its next round."""
    text = TextStream(client.tokenizer, kwargs.get("stop", ()))

    def on_tokens(new: list[int]) -> None:
        if closed.is_set():
            raise StreamClosed
        if piece := text.push(new):
            put(piece)

    def run() -> None:
        try:
            result = client.generate(prompt, on_tokens=on_tokens, **kwargs)
            if tail := text.finish():
                put(tail)
            put(result)
            put(_DONE)
        except StreamClosed:
            pass
        except BaseException as e:  # re-raised in the reader's thread
            put(e)

    threading.Thread(target=run, name="edge-stream", daemon=True).start()


def stream_events(client, prompt: str | list[int], **kwargs) -> Iterator:
    """Text pieces (str) as they become final, then the ClientResult."""
    items: queue.Queue = queue.Queue()
    closed = threading.Event()
    _start(client, prompt, kwargs, items.put, closed)
    try:
        while (item := items.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.set()


async def astream_events(client, prompt: str | list[int], **kwargs) -> AsyncIterator:
    """The asyncio form of stream_events: the event loop stays free while the generation runs."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    closed = threading.Event()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the reader's event loop has closed: nobody reads on
            closed.set()

    _start(client, prompt, kwargs, put, closed)
    try:
        while (item := await items.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.set()
