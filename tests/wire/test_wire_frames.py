"""Bytes that are not what a worker expects, sent by a raw socket: garbage, truncated,
oversized and replayed frames. The worker drops that connection, says why, and goes
on serving a good client."""

import time

import pytest
from wire_helpers import TOKEN, authenticated, dropped, raw, standing  # noqa: F401  (a fixture)
from wire_nodes import Shout

from somatize import Graph, Worker
from somatize.wire.protocol import PREFIX, VERSION, Keyed, encode, new_nonce


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
    sock, channel, _, _ = authenticated(worker.addr)
    sock.sendall(b"".join(bytes(p) for p in encode("slice", {"f": bytes(16), "n": [], "w": []},
                                                    [bytes(200_000)], channel.keyed)))
    assert dropped(sock)
    worker.wait_log("over the limit of 100000")
    still_serving(worker)


def test_a_replayed_frame_fails_its_mac(worker):
    sock, channel, _, _ = authenticated(worker.addr)
    frame = b"".join(bytes(p) for p in encode("catalog", {"c": "sha256:none", "s": bytes(16)}, [],
                                              channel.keyed))
    sock.sendall(frame)
    assert channel.recv().kind == "need"  # the first time it is a request like any other
    sock.sendall(frame)
    assert dropped(sock)
    worker.wait_log("MAC does not match")
    still_serving(worker)


def test_a_replayed_handshake_fails(worker):
    sock, _, sent, _ = authenticated(worker.addr)
    sock.close()
    again = raw(worker.addr)
    for message in sent:  # the same hello and proof, to a worker with a fresh nonce
        again.sendall(message)
    assert dropped(again)
    worker.wait_log("wrong token")
    still_serving(worker)


def test_a_frame_forged_without_the_token_fails(worker):
    sock, _, _, _ = authenticated(worker.addr)
    forged = Keyed(b"\x00" * 32, b"C")
    sock.sendall(b"".join(bytes(p) for p in encode("catalog", {"c": "x"}, [], forged)))
    assert dropped(sock)
    still_serving(worker)


def test_a_frame_without_a_mac_after_the_handshake_is_dropped(worker):
    sock, _, _, _ = authenticated(worker.addr)
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
