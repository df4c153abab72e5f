"""Free ports for services started later or restarted in place: never where outgoing connections land."""

from __future__ import annotations

import socket

from specedge.common.ports import ephemeral_range, free_port


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    first_ephemeral, _ = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < first_ephemeral for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_handed_out_stays_free_while_many_clients_connect():
    """The race this module closes: a client's local port taking a port between its choice and its bind."""
    port = free_port()
    with socket.create_server(("127.0.0.1", 0), backlog=512) as listener:
        clients = [socket.create_connection(listener.getsockname()) for _ in range(300)]
        try:
            assert port not in {c.getsockname()[1] for c in clients}
            with socket.create_server(("127.0.0.1", port)):
                pass
        finally:
            for c in clients:
                c.close()
