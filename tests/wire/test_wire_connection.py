"""One connection on a real worker: a handshake that gives an unproven peer nothing
computed from the token, a clear word for a peer of another version, tracebacks that
travel, a log nobody can forge lines into, and malformed frames from an authenticated
peer that are answered or dropped, never a crash."""

import re
import socket
import threading
import traceback

import msgpack
import pytest
from wire_helpers import (  # noqa: F401  (a fixture)
    TOKEN,
    authenticated,
    dropped,
    frame_bytes,
    hello_bytes,
    raw,
    standing,
)
from wire_nodes import Behind, Boom, Shout

from somatize import Broker, Graph, NodeError, ProtocolError, WireError, Worker
from somatize._errors import OutOfStep
from somatize.wire.channel import Channel
from somatize.wire.transport import RemoteTraceback
from somatize.wire.protocol import HANDSHAKE, PREFIX, VERSION, Limits, decode, new_nonce


def frames_until_closed(sock: socket.socket) -> list:
    """Every frame the worker sends before it closes this connection."""
    data = b""
    sock.settimeout(5)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return decode(data, HANDSHAKE)


# -- 4. the handshake -----------------------------------------------------------------
def test_a_peer_that_has_not_proven_the_token_receives_nothing_computed_from_it(standing):
    worker = standing()
    challenges = []
    for _ in range(2):
        sock = raw(worker.addr)
        channel = Channel(sock, Limits())
        sock.sendall(hello_bytes())
        challenge = channel.recv(HANDSHAKE)
        challenges.append(challenge.header)
        # a wrong proof: what comes back is a refusal and nothing else
        sock.sendall(frame_bytes("proof", {"p": bytes(32)}))
        (refused,) = frames_until_closed(sock)
        assert refused.kind == "refused" and set(refused.header) == {"k", "why"}
        assert "does not know this worker's token" in refused.header["why"]
    first, second = challenges
    # the version, a fresh nonce, whether a token is asked for, the worker's instance
    # and its salt: random or public, nothing derived from the token
    assert set(first) == set(second) == {"k", "v", "n", "a", "i", "s"}
    assert first["n"] != second["n"] and first["s"] == second["s"] and first["a"] is True
    worker.wait_log("wrong token: the client's proof does not match")
    with Worker.at(worker.addr, token=TOKEN) as good:
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": good}) == "X"


def test_a_client_with_the_wrong_token_learns_it_after_proving(standing):
    worker = standing()
    with pytest.raises(WireError, match="refused us: the client does not know") as caught:
        Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": Worker.at(
            worker.addr, token="another-token-of-the-same-length-7777777777777")})
    assert caught.value.host == "w1" and isinstance(caught.value, PermissionError)


def v1_hello() -> bytes:
    """The greeting of somatize 1.0 (wire protocol 1), byte for byte as it sent it."""
    head = msgpack.packb({"v": 1, "n": new_nonce(), "t": 30.0, "k": "hello"}, use_bin_type=True)
    return b"SZ\x01\x00" + len(head).to_bytes(4, "little") + bytes(8) + bytes(32) + head


def test_an_old_client_is_told_the_versions_and_what_to_do_not_left_hanging(standing):
    worker = standing()
    sock = raw(worker.addr)
    sock.sendall(v1_hello())
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(65536):  # the worker says why, and closes
        data += chunk
    # In protocol 1's layout, which a 1.0 client reads: prefix, no MAC, a msgpack header.
    assert data[:3] == b"SZ\x01" and data[3] == 0
    size = int.from_bytes(data[4:8], "little")
    assert len(data) == PREFIX + size and data[8:16] == bytes(8)
    header = msgpack.unpackb(data[PREFIX:], raw=False)
    assert header["k"] == "refused"
    assert f"wire protocol {VERSION} and the client 1" in header["why"]
    assert "install the same somatize on both ends" in header["why"]
    worker.wait_log(f"the client speaks wire protocol 1 and this side speaks {VERSION}; refused")


def test_a_version_nested_past_what_repr_follows_is_refused_in_words(standing):
    worker = standing()
    sock = raw(worker.addr)
    sock.sendall(frame_bytes("hello", {"v": _nested(1000), "n": new_nonce()}))
    (refused,) = frames_until_closed(sock)
    assert refused.kind == "refused" and "and the client a list: install" in refused.header["why"]
    log = worker.wait_log("the client speaks wire protocol 'a list nested too de'")
    assert "unexpected" not in log


def test_a_new_client_of_an_old_worker_hears_why_it_was_closed_on():
    # What a 1.0 worker did with a frame of another version: read its prefix, and close.
    listener = socket.create_server(("127.0.0.1", 0))

    def old_worker() -> None:
        sock, _ = listener.accept()
        assert sock.recv(PREFIX, socket.MSG_WAITALL)[2] == VERSION
        sock.close()

    thread = threading.Thread(target=old_worker)
    thread.start()
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(WireError) as caught:
        Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": Worker.at(addr, token=TOKEN)})
    thread.join()
    listener.close()
    message = str(caught.value)
    assert "as soon as it was greeted" in message and "older somatize" in message
    assert f"another wire protocol than {VERSION}" in message and addr in message


# -- 5. a traceback from over there ------------------------------------------------
def test_a_node_raising_on_a_worker_shows_the_workers_frames_here_and_in_its_log(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w1, pytest.raises(NodeError) as caught:
        Graph.somatize(Boom().at("w1")).forward(2, broker={"w1": w1})
    remote = caught.value.__cause__
    assert isinstance(remote, RemoteTraceback) and remote.host == "w1"
    printed = "".join(traceback.format_exception(caught.value))
    assert re.search(r'File ".*wire_nodes\.py", line \d+, in forward', printed)
    assert 'raise ValueError(f"boom on {x!r}")' in printed
    assert "ValueError: boom on 2" in printed
    assert "The above exception was the direct cause of the following exception" in printed
    assert printed.index("wire_nodes.py") < printed.index("NodeError")  # the worker's first
    log = worker.wait_log("ValueError: boom on 2")
    assert re.search(r"\n      File \".*wire_nodes\.py\", line \d+, in forward\n", log)
    assert "slice ['boom'] failed after" in log


def test_one_of_our_errors_keeps_its_class_and_its_traceback(standing):
    worker = standing()
    with Worker.at(worker.addr, token=TOKEN) as w1, pytest.raises(NodeError) as caught:
        Graph.somatize(Behind().at("w1")).forward(3, broker={"w1": w1})
    cause = caught.value.__cause__
    assert isinstance(cause, OutOfStep) and isinstance(cause.__cause__, RemoteTraceback)
    printed = "".join(traceback.format_exception(caught.value))
    assert "wire_nodes.py" in printed and "OutOfStep" in printed


# -- 6. a slice's form, said once per connection --------------------------------------
def test_a_slice_says_its_form_once_and_names_it_by_number_after(standing):
    worker = standing()
    graph = Graph.somatize(Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:  # a session the hand-made slices run in
        held = Broker({"w1": w1}).session()
        assert graph.forward("x", broker=held) == "X"
    sock, channel, _, _ = authenticated(worker.addr)
    form = {"n": ["shout"], "w": ["shout"], "s": held.id}

    def send(header, text):
        channel.send("slice", {**header, "f": new_nonce()[:16], "v": {"i": text, "g": {}}})

    def call(header, text):
        send(header, text)
        return channel.recv()
    said = call({**form, "p": 0}, "said in full")
    assert said.kind == "done" and said.header["v"] == {"shout": "SAID IN FULL"}
    named = call({"p": 0}, "named")
    assert named.kind == "done" and named.header["v"] == {"shout": "NAMED"}
    assert call(form, "neither").header["v"] == {"shout": "NEITHER"}  # no number: as ever
    send({"p": 5}, "never said")  # a number this connection was never told: dropped
    assert dropped(sock)
    worker.wait_log("a slice naming form 5, which this connection was never told")
    sock, channel, _, _ = authenticated(worker.addr)  # a new connection knows no form
    send({"p": 0}, "named elsewhere")
    assert dropped(sock)
    sock, channel, _, _ = authenticated(worker.addr)
    send({**form, "p": 1}, "out of order")  # forms are numbered 0, 1, 2... as they come
    assert dropped(sock)
    worker.wait_log("a slice numbering its form 1 where 0 was next")


def test_the_client_says_a_form_in_full_once_per_connection(standing):
    worker = standing()
    graph = Graph.somatize(Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:
        sizes = []
        for _ in range(3):
            before = w1.link.traffic()["sent"]
            assert graph.forward("x", broker={"w1": w1}) == "X"
            sizes.append(w1.link.traffic()["sent"] - before)
        # the first slice said its session, nodes and outputs; the others a number
        assert sizes[1] == sizes[2] < sizes[0] - 30
        w1.link.close()  # a new connection: the form is said in full again, and runs
        before = w1.link.traffic()["sent"]
        assert graph.forward("y", broker={"w1": w1}) == "Y"
        assert w1.link.traffic()["sent"] - before > sizes[1]


# -- 7. the log, and malformed frames from an authenticated peer --------------------
FORGED = "\n2030-01-01 00:00:00.000 somatize.worker[1] connection 9 from 10.0.0.1:1: authenticated in 0.1 ms"


def test_text_an_unauthenticated_peer_sends_never_forges_a_line_of_the_log(standing):
    worker = standing()
    sock = raw(worker.addr)  # a refusal, worded as a log line, after a proper hello
    sock.sendall(hello_bytes())
    Channel(sock, Limits()).recv(HANDSHAKE)
    sock.sendall(frame_bytes("refused", {"why": FORGED + "\r\x1b[2J" + "x" * 3000}))
    assert dropped(sock)
    sock = raw(worker.addr)  # a version that is not one, worded the same way
    sock.sendall(frame_bytes("hello", {"v": "2" + FORGED, "n": new_nonce()}))
    assert dropped(sock)
    sock = raw(worker.addr)  # a kind that is not one
    sock.sendall(frame_bytes("hello", {"n": new_nonce()}).replace(b"\xa5hello", b"\xa5hel\nl"))
    assert dropped(sock)
    log = worker.wait_log("the client refused us")
    log = worker.wait_log("a frame of unknown kind")
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} somatize\.worker\[\d+\] ")
    lines = log.rstrip("\n").split("\n")
    assert all(stamp.match(line) and "2030-01-01" not in line[:30] for line in lines), log
    assert all(len(line) < 700 for line in lines)
    assert "\\n2030-01-01" in log and "\\x1b[2J" in log and "\r" not in log


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class Forgery:
    """Frames an authenticated client could send: every kind, headers of any shape,
    and slices that are nearly right, so that most of them reach the walk."""

    def __init__(self, st, session: bytes):
        scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
                   | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=24))
        anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                                | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                                max_leaves=12)
        # as deep as msgpack nests (about a thousand), past Python's recursion limit
        anything = anything | st.integers(900, 1020).map(lambda depth: _nested(depth))
        names = st.lists(st.sampled_from(["shout", "boom", "nowhere", ""]), max_size=3)
        tree = anything | st.fixed_dictionaries({}, optional={  # the codec's own markers
            "__soma_opaque__": st.sampled_from(["torch.tensor", "nope"]) | anything,
            "__soma_bytes__": st.integers(-2, 4) | anything,
            "__soma_tuple__": anything, "buffer": st.integers(-2, 4) | anything})
        given = st.dictionaries(st.sampled_from(["shout", "boom", "x"]), tree, max_size=2)
        sessions = st.just(session) | st.binary(max_size=20) | anything
        nearly = st.fixed_dictionaries(
            {"n": names, "w": names, "f": st.binary(min_size=16, max_size=16),
             "v": st.fixed_dictionaries({"i": tree}, optional={"g": given | anything}),
             "s": st.just(session) | st.just(session) | sessions},
            optional={"r": names | anything, "x": st.booleans() | anything,
                      "t": st.booleans() | anything, "p": st.integers(-1, 2) | anything})
        wild = st.dictionaries(st.sampled_from(["n", "w", "f", "v", "r", "x", "t", "c", "kind",
                                                "s", "p"]), anything | sessions, max_size=5)
        self.frame = st.one_of(
            st.tuples(st.just("slice"), nearly, st.lists(st.binary(max_size=64), max_size=3),
                      st.booleans()),
            st.tuples(st.sampled_from(["slice", "catalog", "provision", "end", "hello", "ok",
                                       "done", "beat", "error", "refused", "proof"]),
                      wild, st.lists(st.binary(max_size=64), max_size=3), st.booleans()))


SOMATIZE_ERRORS = {"NodeError", "DeclarationError", "EdgeError", "UnwritableError", "Lost",
                   "ProtocolError", "CacheError", "OutOfStep", "NoGradient", "catalog",
                   "session"}


@pytest.mark.slow
def test_fuzz_malformed_frames_from_an_authenticated_peer_are_answered_or_dropped(standing):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    worker = standing("--timeout", "2")
    graph = Graph.somatize(Shout().at("w1") >> Boom().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as w1:  # a session the forged slices can run in
        held = Broker({"w1": w1}).session()
        with pytest.raises(NodeError):
            graph.forward("x", broker=held)
    outcomes: dict[str, int] = {}
    forgery = Forgery(st, held.id)

    @hypothesis.settings(max_examples=150, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(forgery.frame)
    def one(frame):
        kind, header, buffers, sealed = frame
        sock, channel, _, _ = authenticated(worker.addr)
        try:
            try:
                channel.send(kind, header, buffers, sealed=sealed)
            except ProtocolError:  # an int msgpack cannot carry: not a frame at all
                outcomes["unsendable"] = outcomes.get("unsendable", 0) + 1
                return
            sock.settimeout(5)  # a slice that imports torch takes longer, and beats meanwhile
            try:
                answer = channel.recv()
                while answer.kind == "beat":
                    answer = channel.recv()
            except (ConnectionError, ProtocolError):  # its reason is in the log by now
                outcomes["dropped"] = outcomes.get("dropped", 0) + 1
                assert "unexpected" not in worker.log()
                return
            if answer.kind == "error":
                assert answer.header["e"] in SOMATIZE_ERRORS, answer.header
            outcomes[answer.kind] = outcomes.get(answer.kind, 0) + 1
        finally:
            sock.close()
        assert worker.proc.poll() is None

    one()
    log = worker.log()
    assert worker.proc.poll() is None
    assert "unexpected" not in log and "Traceback" not in log.replace("    Traceback", ""), log
    assert sum(outcomes.values()) >= 150 and outcomes.get("dropped") and outcomes.get("error")
    with Worker.at(worker.addr, token=TOKEN) as w1:
        assert Graph.somatize(Shout().at("w1")).forward("still", broker={"w1": w1}) == "STILL"
