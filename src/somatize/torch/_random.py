"""The random state of a process, and of each process a graph runs on.

What ``random_state`` takes is every generator a training step may draw from without
being handed one: torch's CPU generator, each CUDA device's (only once CUDA is in use,
so that asking never starts it), Python's ``random``, and numpy's global generator
where numpy is loaded. A host is reached by a one-node graph placed on it, the same
channel its slices come by, so any broker reaches it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any

import torch

from .._engine import execute
from .._errors import DeclarationError, NodeError
from .._graph import Graph
from .._node import Node

__all__ = ["HERE", "RandomState", "check_random", "on_host", "random_state", "seeded",
           "set_random", "where"]

HERE = ""  # the host key of this process's random state


def random_state() -> dict[str, Any]:
    """This process's random state: torch (CPU, and each CUDA device once CUDA is in
    use), Python's ``random``, and numpy's global generator where numpy is loaded."""
    version, inner, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "random": [version, list(inner), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def check_random(state: Mapping[str, Any], host: str) -> None:
    """Refuses a random state this process could not take whole."""
    cuda = state.get("cuda")
    if cuda and (not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda)):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise DeclarationError(
            f"the checkpoint holds the random state of {len(cuda)} CUDA device(s) "
            f"{where(host)}, which has {have}; resume where the run had as many devices")
    if "numpy" in state and "numpy" not in sys.modules and find_spec("numpy") is None:
        raise DeclarationError(f"the checkpoint holds numpy's random state {where(host)}, "
                               "where numpy is not installed; install it there")


def set_random(state: Mapping[str, Any]) -> None:
    """Takes a random state that ``random_state`` answered."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
    version, inner, gauss = state["random"]
    random.setstate((version, tuple(inner), gauss))
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss,
                                cached))


def seeded(seed: int) -> None:
    """Seeds every generator ``random_state`` keeps, in this process."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def where(host: str) -> str:
    """Where a random state was, in words."""
    return "here" if host == HERE else f"on host {host!r}"


class RandomState(Node):
    """Stands on a host to answer that process's random state, or to check and set it."""

    def forward(self, value: Any, ctx: Any) -> Any:
        if value is None:
            return random_state()
        if "seed" in value:
            seeded(value["seed"])
            return True
        check_random(value["state"], value["host"])
        if not value["check"]:
            set_random(value["state"])
        return True


_GRAPHS: dict[str, Graph] = {}  # one per host, so a worker is told about it once


def on_host(host: str, broker: Any, message: Any) -> Any:
    """What ``RandomState`` answers ``message`` (None: asked for the state) on ``host``."""
    graph = _GRAPHS.get(host)
    if graph is None:
        graph = _GRAPHS[host] = Graph.somatize(RandomState().named("random").at(host))
    try:
        return execute(graph, message, broker=broker)
    except NodeError as exc:
        if isinstance(exc.__cause__, DeclarationError):
            raise DeclarationError(f"{exc.__cause__}; nothing was resumed") from exc
        raise
