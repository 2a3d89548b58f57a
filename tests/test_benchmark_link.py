"""The slow link the split benchmark measures behind (benchmarks/link.py): that it costs
what it says, carries every byte as sent, and ends when closed."""

from __future__ import annotations

import importlib.util
import socket
import threading
from pathlib import Path

import pytest


def _link_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "link.py"
    spec = importlib.util.spec_from_file_location("link_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


link = _link_module()


def test_a_spec_reads_as_delay_and_bytes_per_second():
    assert link.parse("10ms,100mbit") == pytest.approx((0.010, 12.5e6))
    assert link.parse("2ms") == (0.002, None)
    assert link.parse("20ms, 1gbit") == pytest.approx((0.020, 125e6))
    assert link.parse("500us,8kbit") == pytest.approx((0.0005, 1000.0))
    for bad in ("fast", "100mbit", "10ms,10ms", "10ms,0mbit"):
        with pytest.raises(ValueError):
            link.parse(bad)


def test_a_round_trip_costs_twice_the_delay_and_the_bytes_arrive_intact():
    delay = 0.02
    measured = link.round_trips(lambda target: link.Link(target, delay), [64, 256 << 10], repeat=3)
    for took, intact in measured.values():
        assert intact
        # Never faster than the link; the slack is for a busy machine.
        assert 2 * delay * 0.95 <= took <= 2 * delay + 0.25


def test_the_rate_paces_a_large_message_each_way():
    delay, rate, size = 0.005, 12.5e6, 512 << 10  # 100 Mbit/s: 42 ms for 512 KiB each way
    measured = link.round_trips(lambda target: link.Link(target, delay, rate), [size], repeat=2)
    took, intact = measured[size]
    expected = 2 * delay + 2 * size / rate
    assert intact
    assert expected * 0.95 <= took <= expected + 0.3


def test_own_address_names_the_link_where_the_target_named_itself():
    with socket.create_server(("127.0.0.1", 0)) as server:
        target = server.getsockname()[:2]
        said = f"listening at {target[0]}:{target[1]}".encode()

        def answer():
            server.settimeout(5)
            conn, _ = server.accept()
            with conn:
                conn.sendall(said)

        threading.Thread(target=answer, daemon=True).start()
        with link.Link(target, 0.0, own_address=True) as proxy, \
                socket.create_connection(proxy.address, timeout=5) as client:
            heard = client.recv(len(said))
    assert heard == f"listening at {proxy.address[0]}:{proxy.address[1]}".encode()


def test_close_cuts_what_it_carries():
    with socket.create_server(("127.0.0.1", 0)) as server:
        proxy = link.Link(server.getsockname()[:2], 0.0)
        client = socket.create_connection(proxy.address, timeout=5)
        server.settimeout(5)
        far, _ = server.accept()
        proxy.close()
        with client, far:
            far.settimeout(5)
            assert far.recv(1) == b""  # the link's side of the connection is gone
