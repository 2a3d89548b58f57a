"""Frames into memory, against a real worker: what a peer announces costs the worker
only the bytes that actually arrive, and what arrives in full is the same bytes. And
a channel's timeouts over a real connection: a silent peer, a peer that reads
nothing, a deadline, and a patient reader."""

import mmap
import os
import socket
import sys
import threading
import time

import pytest
from wire_helpers import TOKEN, authenticated, standing  # noqa: F401  (a fixture)
from wire_nodes import Bigger, Echo

from somatize import Graph, Worker
from somatize.wire.channel import Channel
from somatize.wire.protocol import PREFIX, Limits, encode

GiB = 1 << 30


def announced(keyed, size: int) -> tuple[bytes, memoryview]:
    """A slice frame announcing one buffer of ``size`` bytes: its prefix and header,
    and the buffer's bytes (zeros, mapped lazily here too, so nothing is committed)."""
    buffer = memoryview(mmap.mmap(-1, size))
    head, view = encode("slice", {"f": bytes(16), "n": [], "w": []}, [buffer], keyed)
    return bytes(head), view


def grown(worker, began: int, settle: float = 0.5) -> int:
    time.sleep(settle)
    return worker.resident() - began


@pytest.mark.slow
def test_a_huge_announced_buffer_costs_only_the_bytes_that_arrive(standing):
    worker = standing("--timeout", "5")
    sock, channel, _, _ = authenticated(worker.addr)
    began = worker.resident()
    head, body = announced(channel.keyed, GiB)
    sock.sendall(head)
    assert grown(worker, began) < 32 << 20  # 1 GiB announced, nothing sent: nothing taken
    sock.sendall(body[: 48 << 20])
    after = grown(worker, began)
    # what came (48 MiB), and at most as much again ahead of it
    assert 40 << 20 < after < 2 * (48 << 20) + (16 << 20), after
    sock.close()


@pytest.mark.slow
def test_a_huge_announced_header_costs_only_the_bytes_that_arrive(standing):
    worker = standing("--timeout", "5", "--max-header", str(GiB))
    sock, channel, _, _ = authenticated(worker.addr)
    began = worker.resident()
    head = bytearray(encode("catalog", {"c": "x"}, [], channel.keyed)[0])
    head[4:8] = GiB.to_bytes(4, "little")  # the MAC is checked only once it all came
    sock.sendall(bytes(head[:PREFIX]))
    sock.sendall(bytes(8 << 20))
    assert grown(worker, began) < 32 << 20
    sock.close()


def test_what_arrives_in_full_is_the_same_bytes_across_every_step(standing):
    worker = standing()
    g = Graph.somatize(Echo().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:
        for size in (0, 1, (4 << 20) - 1, 4 << 20, (40 << 20) + 123):
            data = os.urandom(size)
            assert g.forward(data, broker={"w1": w1}) == data


def test_a_frame_the_worker_would_refuse_is_refused_here_before_a_byte_goes(standing):
    from somatize import ProtocolError

    worker = standing("--max-frame", "100000")
    g = Graph.somatize(Echo().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:
        with pytest.raises(ProtocolError) as caught:
            g.forward(bytes(200_000), broker={"w1": w1})
        assert caught.value.host == "w1" and "--max-frame" in str(caught.value)
        assert "over the far side's limit of 100000 bytes" in str(caught.value)
        assert g.forward(b"small", broker={"w1": w1}) == b"small"  # the same connection, well
    assert worker.wait_log("closed by the client").count(": authenticated in") == 1


def test_an_answer_the_client_would_refuse_comes_back_as_an_error(standing):
    from somatize import WireError
    from somatize.wire.protocol import Limits

    worker = standing()
    g = Graph.somatize(Echo().at("w1"))
    with Worker(worker.addr, token=TOKEN, limits=Limits(frame=300_000)) as w1:
        with pytest.raises(WireError, match="too large for the client") as caught:
            Graph.somatize(Bigger().at("w1")).forward(bytes(200_000), broker={"w1": w1})
        assert caught.value.host == "w1" and "limits=Limits(frame=" in str(caught.value)
        assert g.forward(b"small", broker={"w1": w1}) == b"small"


# -- timeouts -----------------------------------------------------------------------
BEAT = b"".join(bytes(p) for p in encode("beat"))  # a whole frame, unkeyed


@pytest.fixture
def pair():
    """Two ends of a real loopback TCP connection: a Channel's, and its peer's."""
    server = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(server.getsockname())
    far, _ = server.accept()
    server.close()
    yield near, far
    near.close()
    far.close()


def test_a_peer_that_says_nothing_is_a_timeout_at_the_timeout(pair):
    near, _ = pair
    near.settimeout(0.3)
    channel = Channel(near, Limits())
    if sys.platform.startswith("linux"):  # the kernel holds it: no poll before each read
        assert near.gettimeout() is None and near.getblocking()
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        channel.recv()
    assert 0.25 < time.monotonic() - began < 3


def test_a_peer_that_reads_nothing_stops_a_send_at_the_timeout(pair):
    near, _ = pair
    channel = Channel(near, Limits(frame=1 << 30))
    channel.set_timeout(0.3)
    began = time.monotonic()
    with pytest.raises(TimeoutError):  # not an OSError that would say the peer is gone
        channel.send("slice", {"f": bytes(16)}, [bytes(256 << 20)])
    assert 0.25 < time.monotonic() - began < 5


def test_a_deadline_bounds_a_read_in_total_however_the_bytes_trickle(pair):
    near, far = pair
    channel = Channel(near, Limits())
    channel.set_timeout(5.0)
    def trickle():
        for byte in BEAT[:-1]:  # never the whole frame, each byte well within the timeout
            time.sleep(0.05)
            try:
                far.sendall(bytes([byte]))
            except OSError:
                return
    threading.Thread(target=trickle, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        channel.recv(deadline=began + 0.4)
    assert 0.35 < time.monotonic() - began < 3


def test_a_patient_read_outwaits_the_timeout_for_a_frame_to_start(pair):
    near, far = pair
    channel = Channel(near, Limits())
    channel.set_timeout(0.1)
    threading.Timer(0.5, lambda: far.sendall(BEAT)).start()
    assert channel.recv(patient=True).kind == "beat"
    with pytest.raises(TimeoutError):  # and an impatient one does not
        channel.recv()


def test_after_a_deadline_reads_are_bounded_by_the_timeout_again(pair):
    near, far = pair
    channel = Channel(near, Limits())
    channel.set_timeout(5.0)
    with pytest.raises(TimeoutError):
        channel.recv(deadline=time.monotonic() + 0.2)
    channel.set_timeout(5.0)  # what a client does after a call with a deadline: no syscall
    threading.Timer(0.6, lambda: far.sendall(BEAT)).start()
    assert channel.recv().kind == "beat"  # not the 0.2 s the deadline left behind
