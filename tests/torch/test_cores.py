"""A worker started on this machine and this process share the cores (torch/_cores.py,
with wire.declare's half of the bargain): each takes half, where the user set no count,
and a count the user set is left alone on both sides."""

import os

import pytest
import torch
from splitnets import Threads

from somatize import Graph, Worker

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.fixture
def default_threads(monkeypatch):
    """This process as a fresh script starts it: no count set, torch on every core."""
    if CORES < 2:
        pytest.skip("one core: nothing to share")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield
    torch.set_num_threads(before)


def threads_there(worker) -> int:
    return Graph.somatize(Threads().named("count").at("w")).forward(None, broker={"w": worker})


def test_a_worker_started_here_and_this_process_each_take_half_the_cores(default_threads):
    with Worker.generic(mode="network", send=["splitnets"]) as worker:
        there = threads_there(worker)
    assert there == CORES // 2  # torch's default there would be every core
    assert torch.get_num_threads() == CORES - CORES // 2
    assert there + torch.get_num_threads() == CORES


def test_a_count_the_user_set_is_theirs_on_both_sides(default_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(CORES))
    with Worker.generic(mode="network", send=["splitnets"]) as worker:
        there = threads_there(worker)
    assert there == CORES and torch.get_num_threads() == CORES
