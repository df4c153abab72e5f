"""NetworkProxy: an asyncio TCP proxy that makes loopback behave like a real network between edge and cloud.

Each direction of each connection gets a one-way delay (plus uniform jitter in [-jitter, +jitter]), a
bandwidth limit (bytes leave no faster than the link serialises them), and faults: a connection reset
(RST) after a number of bytes or with a probability per chunk, and stalls (the link goes quiet for a while).
Bytes keep their order, as on a TCP stream: jitter delays a chunk but never lets it overtake an earlier one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("specedge.proxy")

CHUNK = 16 << 10  # bytes read at a time: the unit of delay, jitter, stalls and reset probability


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class NetworkConditions:
    delay_ms: float = _setting(0.0, "one-way delay, each direction")
    jitter_ms: float = _setting(0.0, "uniform jitter added to the delay, in [-jitter, +jitter]")
    bandwidth_mbps: float = _setting(0.0, "link rate each direction, megabits per second (0 = unlimited)")
    reset_after_bytes: int = _setting(0, "reset each connection after this many bytes (either way; 0 = never)")
    reset_probability: float = _setting(0.0, "chance that a chunk resets its connection")
    stall_probability: float = _setting(0.0, "chance that a chunk stalls its direction for --stall-ms")
    stall_ms: float = _setting(0.0, "length of a stall")
    seed: int | None = _setting(None, "seed of the jitter and fault draws (reproducible runs)")

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "bandwidth_mbps", "reset_after_bytes", "stall_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("reset_probability", "stall_probability"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms ({self.jitter_ms}) cannot exceed delay_ms ({self.delay_ms})")


class _Reset(Exception):
    pass


class NetworkProxy:
    def __init__(self, upstream: str, conditions: NetworkConditions | None = None) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self.conditions = conditions or NetworkConditions()
        self.rng = random.Random(self.conditions.seed)
        self.connections = 0
        self.resets = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; the port listened on."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, client_reader, client_writer) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(client_writer)
            self._tasks.discard(task)
            return
        budget = [self.conditions.reset_after_bytes or None]  # shared by both directions
        directions = [asyncio.create_task(self._carry(client_reader, up_writer, budget)),
                      asyncio.create_task(self._carry(up_reader, client_writer, budget))]
        try:
            done, pending = await asyncio.wait(directions, return_when=asyncio.FIRST_EXCEPTION)
            failures = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            # A direction that failed (a reset drawn here, or one from either end) breaks the connection both
            # ways: carrying on with the other would leave its end waiting on a peer that is gone.
            if failures:
                self.resets += any(isinstance(e, _Reset) for e in failures)
                for t in pending:
                    t.cancel()
                _reset(client_writer)
                _reset(up_writer)
            else:
                await asyncio.gather(*pending, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is stopping
        finally:
            for t in directions:
                t.cancel()
            await asyncio.gather(*directions, return_exceptions=True)  # each ends its own delivery task
            for writer in (client_writer, up_writer):
                writer.close()
            self._tasks.discard(task)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, budget: list) -> None:
        """One direction: read chunks, schedule each for delivery, deliver in order."""
        c, queue = self.conditions, asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        link_free_at = last_due = time.monotonic()
        try:
            while chunk := await reader.read(CHUNK):
                if budget[0] is not None:
                    if len(chunk) >= budget[0]:
                        queue.put_nowait((time.monotonic() + c.delay_ms / 1e3, chunk[: budget[0]]))
                        queue.put_nowait(None)
                        await deliver
                        raise _Reset()
                    budget[0] -= len(chunk)
                if c.reset_probability and self.rng.random() < c.reset_probability:
                    raise _Reset()
                now = time.monotonic()
                if c.stall_probability and self.rng.random() < c.stall_probability:
                    link_free_at = max(link_free_at, now) + c.stall_ms / 1e3
                sent = max(link_free_at, now) + (len(chunk) * 8 / (c.bandwidth_mbps * 1e6) if c.bandwidth_mbps else 0)
                link_free_at = sent
                jitter = self.rng.uniform(-c.jitter_ms, c.jitter_ms) if c.jitter_ms else 0.0
                last_due = max(last_due, sent + (c.delay_ms + jitter) / 1e3)  # no overtaking
                queue.put_nowait((last_due, chunk))
            queue.put_nowait(None)
            await deliver
            if writer.can_write_eof():
                writer.write_eof()
        finally:
            deliver.cancel()
            await asyncio.gather(deliver, return_exceptions=True)

    @staticmethod
    async def _deliver(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while (item := await queue.get()) is not None:
            due, chunk = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST, as a broken network does, not a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def parse_conditions(spec: str) -> NetworkConditions:
    """NetworkConditions from "delay_ms=20,jitter_ms=5,bandwidth_mbps=50" (the fields' names)."""
    fields = {f for f in NetworkConditions.__dataclass_fields__}
    values = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"bad network condition {item!r}; use name=value with names from {sorted(fields)}")
        values[name] = int(value) if name in ("reset_after_bytes", "seed") else float(value)
    return NetworkConditions(**values)


class EmbeddedProxy:
    """A NetworkProxy on loopback, run on a background thread of this process (tests, `specedge bench`)."""

    def __init__(self, upstream: str, conditions: NetworkConditions) -> None:
        self.proxy = NetworkProxy(upstream, conditions)
        self._loop = asyncio.new_event_loop()
        port = self._loop.run_until_complete(self.proxy.start())
        self.target = f"127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="network-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> EmbeddedProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_proxy(listen: str, upstream: str, conditions: NetworkConditions) -> None:
    """Serve until interrupted (`specedge proxy`)."""
    host, _, port = listen.rpartition(":")

    async def main() -> None:
        proxy = NetworkProxy(upstream, conditions)
        bound = await proxy.start(host or "127.0.0.1", int(port))
        log.info(json.dumps({"event": "proxying", "listen": f"{host}:{bound}", "upstream": upstream,
                             **{k: v for k, v in vars(conditions).items() if v}}))
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
