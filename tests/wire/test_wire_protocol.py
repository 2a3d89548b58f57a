"""The frame format as pure functions: round trips, MACs, limits, and a fuzz test that
whatever bytes arrive, the parser answers with frames or a ProtocolError."""

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from somatize import ProtocolError
from somatize.wire.protocol import (
    HANDSHAKE,
    PREFIX,
    VERSION,
    Limits,
    OtherVersion,
    Keyed,
    decode,
    derive_key,
    encode,
    proof,
    refusal,
    connection_key,
)

ROOMY = Limits(header=1 << 20, frame=1 << 24, buffers=64)


def joined(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def pair() -> tuple[Keyed, Keyed]:
    key = connection_key(b"token", b"c" * 32, b"w" * 32)
    return Keyed(key, b"C"), Keyed(key, b"W")


def test_a_frame_round_trips_with_its_buffers_as_they_are():
    tensor_bytes = os.urandom(4096)
    data = joined(encode("slice", {"f": b"\x01" * 16, "n": ["a"], "v": {"x": [1, 2.5, None]}},
                         [tensor_bytes, b""]))
    (frame,) = decode(data, ROOMY)
    assert frame.kind == "slice" and frame.header["v"] == {"x": [1, 2.5, None]}
    assert [bytes(b) for b in frame.buffers] == [tensor_bytes, b""]
    assert frame.size == len(data)


def test_the_overhead_of_a_frame_is_its_prefix_and_a_small_header():
    body = bytes(4 * 1000)
    data = joined(encode("done", {"v": {"n": {"__soma_opaque__": "torch.tensor", "buffer": 0}}},
                         [body], pair()[0]))
    assert len(data) - len(body) < 128


def test_macs_follow_the_sequence_so_a_replay_or_reordering_fails():
    client, worker = pair()
    first = joined(encode("catalog", {"c": "1"}, [], client))
    second = joined(encode("catalog", {"c": "2"}, [], client))
    assert decode(first, ROOMY, worker)[0].header["c"] == "1"
    with pytest.raises(ProtocolError, match="MAC"):
        decode(first, ROOMY, worker)  # the same frame again
    client, worker = pair()
    first = joined(encode("catalog", {"c": "1"}, [], client))
    second = joined(encode("catalog", {"c": "2"}, [], client))
    with pytest.raises(ProtocolError, match="MAC"):
        decode(second, ROOMY, worker)  # out of order
    assert [f.header["c"] for f in decode(first + second, ROOMY, worker)] == ["1", "2"]


def test_a_frame_cannot_be_reflected_back_to_its_sender():
    client, _ = pair()
    frame = joined(encode("ok", {}, [], client))
    with pytest.raises(ProtocolError, match="MAC"):
        decode(frame, ROOMY, Keyed(connection_key(b"token", b"c" * 32, b"w" * 32), b"C"))


def test_a_sealed_frame_covers_its_buffers_and_an_unsealed_one_does_not():
    client, worker = pair()
    sealed = bytearray(joined(encode("provision", {"c": "x"}, [b"blob" * 10], client, sealed=True)))
    sealed[-40] ^= 1  # inside the blob
    with pytest.raises(ProtocolError, match="buffers do not match"):
        decode(bytes(sealed), ROOMY, worker)
    client, worker = pair()
    plain = bytearray(joined(encode("slice", {"c": "x"}, [b"blob" * 10], client)))
    plain[-5] ^= 1
    (frame,) = decode(bytes(plain), ROOMY, worker)
    assert bytes(frame.buffers[0]) != b"blob" * 10  # values are TLS's to protect


def test_limits_refuse_before_reading():
    data = joined(encode("slice", {}, [bytes(1000)]))
    with pytest.raises(ProtocolError, match="over the limit"):
        decode(data, Limits(header=1 << 20, frame=500))
    with pytest.raises(ProtocolError, match="over the limit"):
        decode(joined(encode("hello", {"pad": "x" * 5000})), HANDSHAKE)
    with pytest.raises(ProtocolError, match="malformed buffer sizes"):
        decode(joined(encode("slice", {}, [b"a", b"b", b"c"])), Limits(buffers=2))


def test_the_proofs_differ_by_side_and_by_nonce():
    c, w = b"c" * 32, b"w" * 32
    assert proof(b"t", b"client", c, w) != proof(b"t", b"worker", c, w)
    assert proof(b"t", b"client", c, w) != proof(b"t", b"client", c, b"x" * 32)
    assert proof(b"t", b"client", c, w) != proof(b"u", b"client", c, w)


def test_the_key_is_the_token_through_scrypt_under_the_workers_salt():
    salt = b"s" * 16
    key = derive_key(b"token", salt)
    assert key == hashlib.scrypt(b"token", salt=b"somatize wire 2 " + salt, n=1 << 10, r=8, p=1,
                                 dklen=32)
    assert key != derive_key(b"token", b"t" * 16) and key != derive_key(b"tokem", salt)


def test_an_old_peer_is_refused_in_its_own_layout():
    data = refusal(VERSION, "go away")
    (frame,) = decode(data, HANDSHAKE)
    assert frame.kind == "refused" and frame.header["why"] == "go away"
    old = refusal(1, "go away")
    assert old[:3] == b"SZ\x01" and old[3:] == data[3:]
    with pytest.raises(OtherVersion) as caught:
        decode(old, HANDSHAKE)
    assert caught.value.version == 1 and isinstance(caught.value, ProtocolError)


def test_big_ints_are_refused_with_a_reason():
    with pytest.raises(ProtocolError, match="64 bits"):
        encode("slice", {"v": 2 ** 70})


@pytest.mark.parametrize("key", ["k", "b"])
def test_a_header_may_not_use_the_frames_own_keys(key):
    # a provision's keeps flag once travelled as "k", and arrived as the frame's kind
    with pytest.raises(ProtocolError, match="may not use the keys 'k' and 'b'"):
        encode("provision", {key: True})


def test_packing_a_huge_or_a_refused_header_leaves_the_next_frames_as_they_were():
    before = joined(encode("slice", {"n": ["a"], "v": {"x": [1, 2.5, None]}}, [b"abc"]))
    with pytest.raises(ProtocolError, match="64 bits"):
        encode("slice", {"v": [1, 2 ** 70]})
    (huge,) = decode(joined(encode("slice", {"v": "x" * (3 << 20)})), Limits(header=4 << 20))
    assert huge.header["v"] == "x" * (3 << 20)
    assert joined(encode("slice", {"n": ["a"], "v": {"x": [1, 2.5, None]}}, [b"abc"])) == before


def valid_frames() -> list[bytes]:
    client, _ = pair()
    return [
        joined(encode("hello", {"v": VERSION, "n": b"n" * 32, "t": 1.0})),
        joined(encode("slice", {"n": ["a"], "v": {"g": {"a": [1, "x"]}}}, [b"abc", bytes(9)])),
        joined(encode("catalog", {"c": "sha256:" + hashlib.sha256(b"").hexdigest()}, [], client)),
    ]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_any_bytes_are_frames_or_a_protocol_error(data):
    for keyed in (None, pair()[1]):
        try:
            frames = decode(data, ROOMY, keyed)
        except ProtocolError:
            continue
        assert all(f.kind for f in frames)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(range(3)), st.data())
def test_fuzz_mutated_frames_are_frames_or_a_protocol_error(which, data):
    frame = bytearray(valid_frames()[which])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    for blob in (bytes(frame), bytes(frame[:cut])):
        for keyed in (None, pair()[1]):
            try:
                decode(blob, ROOMY, keyed)
            except ProtocolError:
                pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.integers(0, 10))
def test_fuzz_any_flipped_byte_of_an_authenticated_header_is_caught(payload, where):
    client, worker = pair()
    frame = bytearray(joined(encode("catalog", {"c": payload.hex()}, [], client)))
    at = (PREFIX + where * 7) % len(frame)
    frame[at] ^= 0x5A
    with pytest.raises(ProtocolError):
        decode(bytes(frame), ROOMY, worker)


def channels():
    import socket

    from somatize.wire.channel import Channel

    a, b = socket.socketpair()
    return Channel(a, ROOMY), Channel(b, ROOMY)


def send_in_thread(channel, payloads):
    import threading

    thread = threading.Thread(target=lambda: [channel.send("slice", {}, [p]) for p in payloads])
    thread.start()
    return thread


def test_a_large_buffer_nobody_holds_is_received_into_again():
    sender, receiver = channels()
    first, second = os.urandom(5 << 20), os.urandom(5 << 20)
    thread = send_in_thread(sender, [first, second])
    frame = receiver.recv()
    assert bytes(frame.buffers[0]) == first
    where = id(frame.buffers[0])
    del frame
    frame = receiver.recv()
    thread.join()
    assert bytes(frame.buffers[0]) == second and id(frame.buffers[0]) == where


def test_a_large_buffer_still_held_is_never_written_over():
    sender, receiver = channels()
    first, second = os.urandom(5 << 20), os.urandom(5 << 20)
    thread = send_in_thread(sender, [first, second])
    held = memoryview(receiver.recv().buffers[0])  # what a zero-copy codec would keep
    frame = receiver.recv()
    thread.join()
    assert bytes(held) == first and bytes(frame.buffers[0]) == second


@pytest.mark.parametrize("piece", [3, 48, 1000, 1 << 30])
def test_frames_arriving_in_pieces_of_any_size_are_read_whole(piece):
    import socket
    import threading

    from somatize.wire.channel import Channel

    client, worker = pair()
    sent = [("slice", {"n": ["a"]}, [(bytes(64), bytes(range(256)) * 2)], False),
            ("ok", None, [], False),
            ("provision", {"c": "sha256:x"}, [b"pickled" * 100], True),
            ("slice", {"v": "x" * 70_000}, [os.urandom(70_000), b""], False),
            ("done", {}, [os.urandom(5 << 20)], False)]
    frames = [joined(encode(kind, header, buffers, client, sealed))
              for kind, header, buffers, sealed in sent]
    # The large one in pieces of 64 KiB or more: in pieces of 3 bytes it takes seconds.
    small, large = b"".join(frames[:-1]), frames[-1]

    def write():
        for data, step in ((small, piece), (large, max(piece, 1 << 16))):
            for at in range(0, len(data), step):
                a.sendall(data[at:at + step])

    a, b = socket.socketpair()
    receiver = Channel(b, ROOMY)
    receiver.keyed = worker
    writer = threading.Thread(target=write)
    writer.start()
    try:
        for kind, header, buffers, sealed in sent:
            frame = receiver.recv()
            assert (frame.kind, frame.sealed) == (kind, sealed)
            assert {k: v for k, v in frame.header.items() if k not in ("k", "b")} == (header or {})
            assert [bytes(f) for f in frame.buffers] == [
                b"".join(map(bytes, b)) if isinstance(b, tuple) else bytes(b) for b in buffers]
    finally:
        writer.join()
        a.close()
        b.close()
