"""Free loopback ports for services that bind them later or are restarted on them (tests, benchmarks, local
clusters).

A port found free by binding port 0 comes from the kernel's ephemeral range, the range every outgoing
connection's local port is drawn from too. Between the moment it is found free and the moment a child
process binds it (or a killed server is started again on it), any client socket on the host may take it, and
that bind fails: a race that made cluster and chaos tests fail now and then. Below the ephemeral range no
outgoing connection ever lands, so a port found free there stays free unless someone binds it by number;
each is handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LINUX_EPHEMERAL_RANGE = (32768, 60999)
LOWEST = 10000  # below: ports that well-known and registered services tend to use

_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()  # its own, seeded from the OS: a test's random.seed(...) must not make two processes agree


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (first, last)."""
    try:
        first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return first, last
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing is bound to, outside the ephemeral range, not handed out before by this
    process. Where no such range exists (an ephemeral range starting below LOWEST), any free port."""
    first_ephemeral, _ = ephemeral_range()
    with _lock:
        for _ in range(1000 if first_ephemeral > LOWEST else 0):
            port = _rng.randrange(LOWEST, first_ephemeral)  # at random: two processes rarely try the same
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
