"""The network-emulating proxy (netem/proxy.py) on loopback: the delay, jitter and bandwidth measured
through it are the ones set (within a tolerance for a busy machine), bytes keep their order, faults happen
as configured, and a generation through a faulty link comes out unchanged."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from test_grpc import PROMPT, V, solo_output, tiny_verifier

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableSession
from specedge.edge.transport import RemoteVerifier
from specedge.netem.proxy import EmbeddedProxy, NetworkConditions, NetworkProxy, parse_conditions

SLACK_S = 0.03  # what a loaded 2-core machine may add to a timed round trip


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def through_proxy(conditions: NetworkConditions, exchange):
    server, port = await echo_server()
    proxy = NetworkProxy(f"127.0.0.1:{port}", conditions)
    proxy_port = await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    try:
        return await exchange(reader, writer), proxy
    finally:
        writer.close()
        await proxy.stop()
        server.close()


async def ping_times(reader, writer, n: int = 15) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        writer.write(bytes([i]) * 8)
        await writer.drain()
        assert await reader.readexactly(8) == bytes([i]) * 8
        times.append(time.perf_counter() - start)
    return times


def test_a_round_trip_takes_twice_the_one_way_delay():
    times, _ = asyncio.run(through_proxy(NetworkConditions(delay_ms=40), ping_times))
    assert 0.080 <= statistics.median(times) <= 0.080 + SLACK_S
    assert min(times) >= 0.080


def test_jitter_spreads_round_trips_within_its_bounds():
    times, _ = asyncio.run(through_proxy(NetworkConditions(delay_ms=30, jitter_ms=20, seed=1),
                                         lambda r, w: ping_times(r, w, 30)))
    assert min(times) >= 0.020  # the delay never goes below its bound (a busy machine only adds)
    assert statistics.quantiles(times, n=10)[-1] <= 0.100 + SLACK_S  # the 90th percentile: robust to a hiccup
    assert max(times) - min(times) > 0.015  # really jittered


def test_bytes_keep_their_order_under_jitter():
    async def exchange(reader, writer):
        payload = bytes(range(256)) * 2000  # 512 KB in many chunks, each with its own jitter
        writer.write(payload)
        await writer.drain()
        return await reader.readexactly(len(payload)) == payload

    same, _ = asyncio.run(through_proxy(NetworkConditions(delay_ms=5, jitter_ms=5, seed=2), exchange))
    assert same


def test_the_bandwidth_limit_paces_a_transfer():
    size = 300_000

    async def exchange(reader, writer):
        start = time.perf_counter()
        writer.write(b"x" * size)
        await writer.drain()
        await reader.readexactly(size)
        return time.perf_counter() - start

    seconds, _ = asyncio.run(through_proxy(NetworkConditions(bandwidth_mbps=8), exchange))
    expected = size * 8 / 8e6  # 0.3 s each way; the echo streams back while it arrives
    assert expected <= seconds <= 2 * expected + 0.2


def test_a_stall_holds_the_link():
    times, _ = asyncio.run(through_proxy(NetworkConditions(stall_probability=1.0, stall_ms=60),
                                         lambda r, w: ping_times(r, w, 3)))
    assert min(times) >= 0.060


def test_a_connection_is_reset_after_the_configured_bytes():
    async def exchange(reader, writer):
        writer.write(b"y" * 10_000)
        await writer.drain()
        received = b""
        with pytest.raises(ConnectionResetError):
            while chunk := await reader.read(1 << 16):
                received += chunk
        return len(received)

    received, proxy = asyncio.run(through_proxy(NetworkConditions(reset_after_bytes=4000), exchange))
    assert received < 4000 and proxy.resets == 1


def test_bad_conditions_are_refused():
    with pytest.raises(ValueError, match="jitter_ms"):
        NetworkConditions(delay_ms=5, jitter_ms=10)
    with pytest.raises(ValueError, match="reset_probability"):
        NetworkConditions(reset_probability=1.5)


def test_a_generation_through_a_link_that_resets_comes_out_unchanged():
    """gRPC through the proxy, which resets connections at random: the session resumes each time."""
    params = SamplingParams(temperature=1.0, seed=9, max_new_tokens=40)
    with tiny_verifier() as v:
        want = solo_output(v, params=params)
        with EmbeddedProxy(v.target, NetworkConditions(delay_ms=2, reset_probability=0.08, seed=4)) as link:
            session = ResumableSession(lambda: RemoteVerifier(link.target), PROMPT, params, "c", "",
                                       retries=20, backoff_s=0.01)
            got = generate(session, drafter=FunctionDrafter(lambda c: DraftTree.chain([(c[-1] + 1) % V])))
        assert got.token_ids == want
        assert link.proxy.resets >= 1 and session.resumes >= 1


def test_conditions_parse_from_a_flag_value():
    assert parse_conditions("delay_ms=20, jitter_ms=5,bandwidth_mbps=50,seed=3") == NetworkConditions(
        delay_ms=20, jitter_ms=5, bandwidth_mbps=50, seed=3)
    with pytest.raises(ValueError, match="bad network condition"):
        parse_conditions("latency=20")


def test_an_end_that_resets_its_connection_resets_the_other_end_too():
    """An upstream that goes away with a TCP RST (a killed router) must not leave the client's side open:
    the client would wait on it for ever (found by the chaos test)."""
    import socket
    import struct
    import threading

    upstream = socket.create_server(("127.0.0.1", 0))

    def accept_then_reset() -> None:
        conn, _ = upstream.accept()
        conn.recv(16)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # RST

    threading.Thread(target=accept_then_reset, daemon=True).start()
    with EmbeddedProxy(f"127.0.0.1:{upstream.getsockname()[1]}", NetworkConditions()) as proxy:
        host, port = proxy.target.rsplit(":", 1)
        client = socket.create_connection((host, int(port)), timeout=5)
        client.sendall(b"hello")
        try:
            ended = client.recv(16) == b""  # times out (socket.timeout) if the proxy kept this side open
        except ConnectionResetError:
            ended = True
        assert ended
        client.close()
    upstream.close()
