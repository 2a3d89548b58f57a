"""The wait of a round: one reader per process, whose reads follow what arrives."""

from __future__ import annotations

import threading
import time

import torch

from somatize.store import Store
from somatize.torch import gather
from somatize.torch._watch import reader


def part(k: int) -> dict:
    return {"n": {"w": torch.full((3,), float(k))}}


def test_clients_waiting_in_one_process_share_one_reader_that_reads_little_while_idle(
        tmp_path):
    store = Store(tmp_path / "s", durable=False)
    clients, answers = 20, {}

    def one(k, delay=0.0):
        time.sleep(delay)
        answers[k] = (gather(store, part(k), run="r", round=0, clients=clients, mine=k,
                             asking=0.25), time.monotonic())

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients - 1)]
    threads.append(threading.Thread(target=one, args=(clients - 1, 1.5)))  # a late one
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    reads = reader(store, "fed/r/0").reads
    ended = max(at for _, at in answers.values())
    assert all(torch.equal(a["n"]["w"], torch.full((3,), 9.5)) for a, _ in answers.values())
    # Each of 19 clients asking for the average and the missing part every 0.25 s for
    # 1.5 s would resolve at least 19 * 6 * 2 = 228 names; one reader that backs off,
    # stops at the first missing part and is handed this process's own parts resolves
    # a few names per arrival from elsewhere (here: none) and per backoff step
    assert reads < 100, reads
    # the late part is written in this process, so the others learn of it at once
    assert ended - began < 1.5 + 1.0


def test_a_round_finished_in_another_process_is_seen_within_asking(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    got = {}

    def waiting():
        got["answer"] = gather(store, part(0), run="r", round=0, clients=2, mine=0,
                               asking=0.2)
        got["at"] = time.monotonic()

    thread = threading.Thread(target=waiting)
    thread.start()
    time.sleep(1.0)
    other = Store(tmp_path / "s", durable=False)  # as another process would: no poke
    from somatize._codec import dumps
    other.claim("fed/r/0/client/1", other.put(dumps(part(1))),
                {"client": 1, "clients": 2, "size": None, "by": "elsewhere"})
    written = time.monotonic()
    thread.join(timeout=30)
    assert torch.equal(got["answer"]["n"]["w"], torch.full((3,), 0.5))
    assert got["at"] - written < 0.2 + 0.5
