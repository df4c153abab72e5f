"""Free ports for services started later or restarted in place: never where outgoing connections land."""

from __future__ import annotations

import socket

import pytest

from specedge.common.ports import LOWEST, RANGE_ENV, ephemeral_range, free_port, port_range


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    first_ephemeral, _ = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST <= p < first_ephemeral for p in ports)  # LOWEST: clear of Ray's worker ports too
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


def test_the_environment_confines_free_ports_to_a_range(monkeypatch):
    """Parallel test workers (tests/conftest.py) each pick from their own share: none can take a port another
    has chosen and not yet bound."""
    monkeypatch.setenv(RANGE_ENV, "24000-24099")
    assert port_range() == (24000, 24099)
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(24000 <= p <= 24099 for p in ports)


@pytest.mark.parametrize("value", ["24000", "24000-", "a-b", "24099-24000", "0-10", "60000-70000"])
def test_a_malformed_range_is_refused_with_its_value(monkeypatch, value):
    monkeypatch.setenv(RANGE_ENV, value)
    with pytest.raises(ValueError, match=RANGE_ENV):
        port_range()
