"""Free loopback ports for services that bind them later or are restarted on them (tests, benchmarks, local
clusters).

A port found free by binding port 0 comes from the kernel's ephemeral range, the range every outgoing
connection's local port is drawn from too. Between the moment it is found free and the moment a child
process binds it (or a killed server is started again on it), any client socket on the host may take it, and
that bind fails: a race that made cluster and chaos tests fail now and then. Below the ephemeral range no
outgoing connection ever lands, so a port found free there stays free unless someone binds it by number;
each is handed out once per process.

Processes that pick ports at the same time (parallel test workers, two local clusters) can be given disjoint
ranges by $SPECEDGE_PORTS, so that a port one has chosen and not yet bound is never chosen by the other.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

LINUX_EPHEMERAL_RANGE = (32768, 60999)
# Below: ports that well-known and registered services tend to use, and Ray's worker ports (10002-19999 by
# default), which Ray binds as it starts workers, after we may have found them free.
LOWEST = 20000
RANGE_ENV = "SPECEDGE_PORTS"  # "FIRST-LAST", inclusive: the ports free_port hands out

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


def port_range() -> tuple[int, int]:
    """The ports free_port picks from (first, last; empty where last < first): $SPECEDGE_PORTS, else from
    LOWEST to just below the ephemeral range."""
    value = os.environ.get(RANGE_ENV)
    if not value:
        return LOWEST, ephemeral_range()[0] - 1
    try:
        first, last = map(int, value.split("-"))
    except ValueError:
        raise ValueError(f"{RANGE_ENV}={value!r}: expected FIRST-LAST, e.g. 20000-25999") from None
    if not 0 < first <= last < 65536:
        raise ValueError(f"{RANGE_ENV}={value!r}: expected 0 < FIRST <= LAST < 65536")
    return first, last


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing is bound to, in port_range() (outside the ephemeral range), not handed out
    before by this process. Where that range is empty or used up, any free port."""
    first, last = port_range()
    with _lock:
        for _ in range(1000 if last >= first else 0):
            port = _rng.randint(first, last)  # at random: two processes rarely try the same
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
