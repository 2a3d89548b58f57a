"""The random state of a process, and of each session a graph runs in on a host.

What ``random_state`` takes is every generator a training step may draw from without
being handed one: torch's CPU generator, each CUDA device's (only once CUDA is in use,
so that asking never starts it), Python's ``random``, and numpy's global generator
where numpy is loaded. A host keeps one such state per session and swaps it in around
the session's slices (``wire.host.Resident``, which ``draws`` is what it reads and sets
them with); a session's owner reads, sets or seeds it there by a verb of the session
(``VERBS``), so nobody else's is touched and no session is opened for it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any

import torch

from .._errors import DeclarationError

__all__ = ["HERE", "VERBS", "check_random", "put", "random_state", "seed_verb", "seeded",
           "set_random", "set_random_verb", "state_verb", "taken", "where"]

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


# -- a session's random state on its host, by verb (run within that state) -------------
def state_verb(nodes: Mapping[str, Any], asked: Any) -> dict[str, Any]:
    """``random``: the session's random state."""
    return random_state()


def set_random_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> bool:
    """``set_random``: a kept random state checked, and taken unless ``check`` says this
    is only the check every machine passes before any of them takes its own."""
    check_random(asked["state"], asked["host"])
    if not asked["check"]:
        set_random(asked["state"])
    return True


def seed_verb(nodes: Mapping[str, Any], asked: Mapping[str, Any]) -> bool:
    """``seed``: the session's random state seeded."""
    seeded(asked["seed"])
    return True


VERBS = {"random": state_verb, "set_random": set_random_verb, "seed": seed_verb}


# -- what a host swaps around a session's slices (registered by somatize.torch) ---------
def taken() -> tuple[Any, ...]:
    """The process's random state as it is, uncopied into plain data: what a host holds
    for a session between its slices (cheaper than ``random_state``, which a store keeps)."""
    cuda = (torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    numpy = sys.modules.get("numpy")
    return (torch.get_rng_state(), cuda, random.getstate(),
            numpy.random.get_state() if numpy is not None else None)


def put(state: tuple[Any, ...]) -> None:
    """Sets what ``taken`` answered."""
    generator, cuda, python, numpy_state = state
    torch.set_rng_state(generator)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
