"""Bytes that are not what a worker expects, sent by a raw socket: garbage, truncated,
oversized and replayed frames. The worker drops that connection, says why, and goes
on serving a good client."""

import socket
import time

import pytest
from wire_helpers import TOKEN, standing  # noqa: F401  (a fixture)
from wire_nodes import Shout

from somatize import Graph, Worker
from somatize.wire.channel import Channel
from somatize.wire.protocol import (
    HANDSHAKE,
    PREFIX,
    VERSION,
    Limits,
    Session,
    derive_key,
    encode,
    new_nonce,
    proof,
    session_key,
)


def raw(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def authenticated(addr: str, token: bytes = TOKEN.encode()) -> tuple[socket.socket, Channel, list]:
    """A hand-made client: the handshake done with the protocol's own pieces, and every
    byte it sent kept, so a test can send them again."""
    sock = raw(addr)
    channel = Channel(sock, Limits())
    sent: list[bytes] = []
    client_nonce = new_nonce()
    sent.append(b"".join(bytes(p) for p in encode("hello", {"v": VERSION, "n": client_nonce, "t": 5.0})))
    sock.sendall(sent[-1])
    challenge = channel.recv(HANDSHAKE)
    worker_nonce = challenge.header["n"]
    key = derive_key(token, challenge.header["s"])
    sent.append(b"".join(bytes(p) for p in encode("proof", {"p": proof(key, b"client", client_nonce, worker_nonce)})))
    sock.sendall(sent[-1])
    channel.session = Session(session_key(key, client_nonce, worker_nonce), b"C")
    welcome = channel.recv(HANDSHAKE)
    assert welcome.kind == "welcome"
    assert welcome.header["p"] == proof(key, b"worker", client_nonce, worker_nonce)
    return sock, channel, sent


def dropped(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the worker closed this connection (reading until it does)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    sock.close()
    return True


@pytest.fixture
def worker(standing):
    return standing("--timeout", "1")


def still_serving(worker) -> None:
    with Worker.at(worker.addr, token=TOKEN) as good:
        assert Graph.somatize(Shout().at("w1")).forward("ok", broker={"w1": good}) == "OK"


def test_garbage_is_dropped(worker):
    sock = raw(worker.addr)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: there\r\n\r\n" + b"\x00" * 64)
    assert dropped(sock)
    worker.wait_log("not a somatize frame")
    still_serving(worker)


def test_a_truncated_frame_is_dropped_after_the_timeout(worker):
    sock = raw(worker.addr)
    whole = b"".join(bytes(p) for p in encode("hello", {"v": VERSION, "n": new_nonce()}))
    sock.sendall(whole[: PREFIX + 5])  # the header never finishes
    began = time.monotonic()
    assert dropped(sock)
    assert 0.8 < time.monotonic() - began < 4
    worker.wait_log("handshake not finished within 1.0 s")
    still_serving(worker)


def test_an_oversized_header_is_refused_before_anything_is_allocated(worker):
    sock = raw(worker.addr)
    prefix = bytearray(bytes(encode("hello", {"v": VERSION})[0])[:PREFIX])
    prefix[4:8] = (1 << 30).to_bytes(4, "little")  # a 1 GiB handshake header
    sock.sendall(bytes(prefix))
    assert dropped(sock)
    worker.wait_log("over the limit")
    still_serving(worker)


def test_an_oversized_frame_after_the_handshake_is_refused(standing):
    worker = standing("--max-frame", "100000")
    sock, channel, _ = authenticated(worker.addr)
    sock.sendall(b"".join(bytes(p) for p in encode("slice", {"f": bytes(16), "n": [], "w": []},
                                                    [bytes(200_000)], channel.session)))
    assert dropped(sock)
    worker.wait_log("over the limit of 100000")
    still_serving(worker)


def test_a_replayed_frame_fails_its_mac(worker):
    sock, channel, _ = authenticated(worker.addr)
    frame = b"".join(bytes(p) for p in encode("catalog", {"c": "sha256:none"}, [], channel.session))
    sock.sendall(frame)
    assert channel.recv().kind == "need"  # the first time it is a request like any other
    sock.sendall(frame)
    assert dropped(sock)
    worker.wait_log("MAC does not match")
    still_serving(worker)


def test_a_replayed_handshake_fails(worker):
    sock, _, sent = authenticated(worker.addr)
    sock.close()
    again = raw(worker.addr)
    for message in sent:  # the same hello and proof, to a worker with a fresh nonce
        again.sendall(message)
    assert dropped(again)
    worker.wait_log("wrong token")
    still_serving(worker)


def test_a_frame_forged_without_the_token_fails(worker):
    sock, _, _ = authenticated(worker.addr)
    forged = Session(b"\x00" * 32, b"C")
    sock.sendall(b"".join(bytes(p) for p in encode("catalog", {"c": "x"}, [], forged)))
    assert dropped(sock)
    still_serving(worker)


def test_a_frame_without_a_mac_after_the_handshake_is_dropped(worker):
    sock, _, _ = authenticated(worker.addr)
    sock.sendall(b"".join(bytes(p) for p in encode("catalog", {"c": "x"})))
    assert dropped(sock)
    worker.wait_log("without a MAC")
    still_serving(worker)


def test_an_unknown_kind_and_a_bad_version_are_dropped(worker):
    sock = raw(worker.addr)
    whole = bytearray(b"".join(bytes(p) for p in encode("hello", {"v": VERSION, "n": new_nonce()})))
    whole[2] = VERSION + 1
    sock.sendall(bytes(whole))
    assert dropped(sock)
    worker.wait_log(f"this side speaks {VERSION}")
    sock = raw(worker.addr)
    sock.sendall(b"".join(bytes(p) for p in encode("hello", {"v": VERSION + 1, "n": new_nonce()})))
    sock.settimeout(5)
    assert b"refused" in sock.recv(4096)
    assert dropped(sock)
    still_serving(worker)
