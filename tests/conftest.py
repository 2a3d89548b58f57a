"""What every test shares: a test marked ``cuda`` runs only where torch sees a CUDA
device, and is skipped with the reason anywhere else (CI never needs one); and the real
S3 server of tests/store (``s3_endpoint``, ``credentials``), for the tests up here that
read a store in a bucket (the command line, the README's bucket block); and
``benchmark_file``, which loads one of benchmarks/ as a module for the tests of what
it measures against."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "store"))

from s3server import credentials, s3_endpoint  # noqa: E402,F401  (fixtures, found by name)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark_file(name: str):
    """benchmarks/<name>.py as a module, found the way ``python benchmarks/<name>.py``
    finds its neighbours (``_bench``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def benchmark_file():
    return _benchmark_file


def _without_cuda() -> str | None:
    """Why CUDA tests cannot run here, or None if they can."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA, and torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA device, and torch {torch.__version__} sees none"
    return None


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    why = _without_cuda() if marked else None  # torch is imported only if a test asks
    if why is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))
