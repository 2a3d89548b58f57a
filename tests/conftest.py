"""What every test shares: a test marked ``cuda`` runs only where torch sees a CUDA
device, and is skipped with the reason anywhere else (CI never needs one); and the real
S3 server of tests/store (``s3_endpoint``, ``credentials``), for the tests up here that
read a store in a bucket (the command line, the README's bucket block); and
``benchmark_file``, which loads one of benchmarks/ as a module for the tests of what
it measures against."""

import importlib.util
import os
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


# Where make test runs the tests in parallel processes (pytest-xdist, --dist loadfile),
# a file's tests stay together: its module fixtures (a worker, a trained model) are made
# once, not once per process, and its tests keep the order they were written in. The
# folders in TOGETHER go to one process as a whole: one local Ray cluster is what two
# cores hold, and each process would start its own. (xdist's loadgroup would say this
# with marks, but its groups are lost under pytest 9: it renames items pytest no longer
# reads the names of.) The files in APART are the slowest (each 3-6 minutes of a
# 33-minute run in one process on two busy cores) and their tests stand alone: they go
# first, a test at a time, so that none of them is what the others wait for at the end.
TOGETHER = ("tests/ray/",)
APART = ("tests/test_readme.py", "tests/torch/test_split_shared.py",
         "tests/torch/test_federated.py", "tests/torch/test_checkpoint.py")

if importlib.util.find_spec("xdist") is not None:  # a hook pytest knows only with xdist
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadfile":
            return None  # another --dist: xdist's own
        from xdist.scheduler import LoadFileScheduling

        class Together(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                file = nodeid.split("::", 1)[0]
                if file in APART:
                    return nodeid
                return next((folder for folder in TOGETHER if file.startswith(folder)), file)

        config.option.loadscopereorder = False  # the order collected: APART's tests first
        return Together(config, log)


def _apart_first(items) -> None:
    where = Path(__file__).resolve().parents[1]
    items.sort(key=lambda item: Path(str(item.fspath)).relative_to(where).as_posix() not in APART)


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    why = _without_cuda() if marked else None  # torch is imported only if a test asks
    if why is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))
    if "PYTEST_XDIST_WORKER" in os.environ:
        _apart_first(items)  # in each process xdist starts, so that all collect one order
