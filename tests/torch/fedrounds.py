"""What the round tests share: small exports, the clients' training, rounds run in
threads, and a part kept the way gather keeps it."""

from __future__ import annotations

import threading
import warnings

import torch

from somatize._codec import dumps
from somatize.torch import gather


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"n": {"w": torch.randn(6, generator=g), "b": torch.randn(2, generator=g,
                                                                      dtype=torch.float64),
                  "steps": torch.tensor(seed)}}


def trained(start: dict, client: int, round: int) -> dict:
    g = torch.Generator().manual_seed(100 * round + client)
    return {"n": {"w": start["n"]["w"] + 0.1 * torch.randn(6, generator=g),
                  "b": start["n"]["b"] + 0.1 * torch.randn(2, generator=g, dtype=torch.float64),
                  "steps": start["n"]["steps"] + 1}}


def gathered(store, parts: dict, **how) -> dict:
    """gather for each client in ``parts`` at once, in threads: what each got or raised,
    and the warnings each was given."""
    answers, told = {}, {}

    def one(k):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                answers[k] = gather(store, parts[k], mine=k, **how)
            except Exception as exc:  # noqa: BLE001 - handed to the test
                answers[k] = exc
        told[k] = [str(w.message) for w in caught]

    threads = [threading.Thread(target=one, args=(k,)) for k in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers, told


def keep_as(store, run, round, k, part, clients, size):
    """Client k's part kept as gather keeps it, by a client that then waits elsewhere."""
    store.claim(f"fed/{run}/{round}/client/{k}", store.put(dumps(part)),
                {"client": k, "clients": clients, "size": size, "by": "elsewhere"})
