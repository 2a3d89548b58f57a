"""The random state of a process (somatize.torch._random): taken whole, set back, and a
state this process could not take refused before anything is set."""

import random

import numpy
import pytest
import torch

from somatize import DeclarationError
from somatize.torch._random import HERE, check_random, random_state, seeded, set_random


def draws():
    return (torch.rand(3).tolist(), random.random(), float(numpy.random.rand()))


def test_a_random_state_set_back_draws_the_same_again():
    seeded(11)
    kept = random_state()
    first = draws()
    assert draws() != first
    set_random(kept)
    assert draws() == first
    assert set(kept) >= {"torch", "random", "numpy"}
    if not torch.cuda.is_initialized():
        assert "cuda" not in kept  # asking never starts CUDA


def test_cuda_states_for_devices_this_process_lacks_are_refused():
    state = random_state()
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state["cuda"] = [torch.get_rng_state()] * (have + 1)
    said = rf"{have + 1} CUDA device\(s\) here, which has {have}"
    with pytest.raises(DeclarationError, match=said):
        check_random(state, HERE)
    with pytest.raises(DeclarationError, match="on host 'gpu'"):
        check_random(state, "gpu")
