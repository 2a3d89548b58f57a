"""Who gets into a worker, against real worker processes on real sockets: a handshake
bounded in total, connections bounded in number with the oldest unauthenticated one
making room, and a worker out of descriptors that waits instead of spinning."""

import os
import select
import socket
import ssl
import threading
import time

import pytest
from wire_helpers import (  # noqa: F401  (fixtures)
    TOKEN,
    authenticated,
    certificate,
    hello_bytes,
    raw,
    standing,
)
from wire_nodes import Shout, Take, Untake

from somatize import Graph, WireError, Worker


def served(addr: str, said: str = "ok", **worker) -> bool:
    with Worker.at(addr, token=TOKEN, **worker) as good:
        return Graph.somatize(Shout().at("w1")).forward(said, broker={"w1": good}) == said.upper()


def closed(sock: socket.socket) -> bool:
    """Whether the far side has closed this socket, without waiting."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BlockingIOError):
        return True


def dribble(socks: list[socket.socket], data: bytes, every: float, within: float) -> dict:
    """Sends ``data`` one byte every ``every`` seconds on each socket; answers how long
    each lasted before the worker closed it (None if it never did)."""
    began = time.monotonic()
    lasted: dict[int, float | None] = {i: None for i in range(len(socks))}
    at = 0
    while time.monotonic() - began < within and any(v is None for v in lasted.values()):
        for i, sock in enumerate(socks):
            if lasted[i] is not None:
                continue
            if closed(sock):
                lasted[i] = time.monotonic() - began
                continue
            try:
                sock.send(data[at % len(data):at % len(data) + 1])
            except OSError:
                lasted[i] = time.monotonic() - began
        at += 1
        time.sleep(every)
    return lasted


# -- 1. the whole handshake in --timeout --------------------------------------------
@pytest.mark.slow
def test_a_dribbling_handshake_is_dropped_within_the_timeout_in_total(standing):
    worker = standing("--timeout", "2")
    socks = [raw(worker.addr) for _ in range(6)]
    hello = hello_bytes()  # valid bytes, one at a time: each silence a quarter of the timeout
    answered = []
    helper = threading.Timer(0.8, lambda: answered.append(served(worker.addr)))
    helper.start()
    lasted = dribble(socks, hello, every=0.5, within=8)
    helper.join()
    assert answered == [True]  # a client was served while they dribbled
    assert all(v is not None and 1.9 < v < 4 for v in lasted.values()), lasted
    assert worker.log().count("handshake not finished within 2.0 s; dropped") == 6


@pytest.mark.slow
def test_a_dribbling_tls_handshake_counts_against_the_same_timeout(standing, certificate):
    cert, key = certificate
    worker = standing("--timeout", "2", "--tls-cert", cert, "--tls-key", key)
    context = ssl.create_default_context(cafile=cert)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    client_hello = outgoing.read()
    socks = [raw(worker.addr) for _ in range(3)]
    lasted = dribble(socks, client_hello, every=0.5, within=8)
    assert all(v is not None and 1.9 < v < 4 for v in lasted.values()), lasted
    assert served(worker.addr, tls=cert)


# -- 2. connections bounded, the oldest unauthenticated makes room -------------------
@pytest.mark.slow
def test_a_flood_of_idle_connections_holds_few_threads_and_locks_nobody_out(standing):
    worker = standing()
    assert served(worker.addr)
    before = worker.threads()
    peak = [before]
    flooding = threading.Event()

    def watch() -> None:
        while not flooding.is_set():
            peak[0] = max(peak[0], worker.threads())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        idle = [raw(worker.addr) for _ in range(1500)]
        time.sleep(1.0)
        held = worker.threads()
        assert served(worker.addr)  # the newest of them all, and the oldest idle one goes
    finally:
        flooding.set()
        watcher.join()
    assert held <= before + 16, (before, held)
    # at the peak, those pushed out in one batch of accepts (64) may not have ended yet
    assert peak[0] <= before + 16 + 2 * 64, (before, peak[0])
    log = worker.log()
    assert "to make room for a newer connection" in log
    assert log.count("\n") < 30  # 1,484 connections dropped, and a few lines to say so
    for sock in idle:
        sock.close()


def test_an_authenticated_client_is_never_locked_out_and_a_full_worker_says_so(standing):
    worker = standing("--max-connections", "4", "--max-unauthenticated", "2")
    held = [authenticated(worker.addr) for _ in range(2)]
    idle = [raw(worker.addr) for _ in range(10)]
    time.sleep(0.3)
    assert served(worker.addr)  # two authenticated, two idle: the oldest idle makes room
    worker.wait_log("closed by the client")  # its slot is free again
    held += [authenticated(worker.addr) for _ in range(2)]
    with pytest.raises(WireError, match="holds its most connections") as caught:
        served(worker.addr, timeout=3)
    assert caught.value.host == "w1"
    held.pop()[0].close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # its thread notices the close, and the slot frees
        try:
            assert served(worker.addr)
            break
        except WireError:
            time.sleep(0.1)
    else:
        raise AssertionError(f"a slot never freed up:\n{worker.log()}")
    for sock in idle + [h[0] for h in held]:
        sock.close()


# -- 3. out of descriptors ------------------------------------------------------------
@pytest.mark.slow
def test_idle_connections_cannot_take_the_descriptors_of_a_limited_worker(standing):
    worker = standing(files=64)
    worker.wait_log("the descriptor limit is 64")
    idle = [raw(worker.addr) for _ in range(80)]
    time.sleep(0.5)
    cpu = worker.cpu_seconds()
    began = time.monotonic()
    assert served(worker.addr)
    time.sleep(2.0)
    used = (worker.cpu_seconds() - cpu) / (time.monotonic() - began)
    assert used < 0.3, f"the worker used {used:.0%} of a core while idle connections waited"
    assert "cannot accept" not in worker.log()
    for sock in idle:
        sock.close()


@pytest.mark.slow
def test_out_of_descriptors_the_worker_waits_serves_whom_it_holds_and_recovers(standing):
    worker = standing(files=64)
    g = Graph.somatize(Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN) as held:
        took = Graph.somatize(Take().at("w1")).forward(None, broker={"w1": held})
        assert took > 20  # a node holds every descriptor the worker had left
        waiting = [raw(worker.addr) for _ in range(20)]  # they wait in the kernel's queue
        worker.wait_log("cannot accept connections: Too many open files")
        cpu, began = worker.cpu_seconds(), time.monotonic()
        for said in ("a", "b", "c"):  # the client it holds is served all along
            assert g.forward(said, broker={"w1": held}) == said.upper()
            time.sleep(1.0)
        used = (worker.cpu_seconds() - cpu) / (time.monotonic() - began)
        assert used < 0.3, f"the worker used {used:.0%} of a core out of descriptors"
        assert worker.log().count("cannot accept connections") == 1
        for sock in waiting:
            sock.close()
        assert Graph.somatize(Untake().at("w1")).forward(None, broker={"w1": held}) == took
    worker.wait_log("accepting connections again")
    assert served(worker.addr)
    assert os.path.exists(f"/proc/{worker.proc.pid}")
