"""What the torch tests share: torch itself. Where it is missing the whole directory
is left out, and the header of the run says why, so no file repeats a skip block."""

import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None

if not HAS_TORCH:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if not HAS_TORCH:
        return "tests/torch: skipped, torch is not installed (pip install 'somatize[torch]')"
    return None


@pytest.fixture
def one_thread():
    """torch on one thread for a test, as it was before afterwards: a module whose
    figures are compared bit for bit with a hand-written loop asks for it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
