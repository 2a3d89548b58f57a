"""The public face: what ``somatize`` exports, sorted, and nothing private."""

import importlib.metadata

import somatize

SEED_NAMES = {"Bound", "Broker", "Ctx", "Graph", "Node", "Opaque", "Recorder", "Store",
              "Worker", "codec", "codecs_registered", "__version__"}


def test_all_is_sorted_and_holds_the_seed_names():
    assert somatize.__all__ == sorted(somatize.__all__)
    assert SEED_NAMES <= set(somatize.__all__)
    assert somatize.__version__ == importlib.metadata.version("somatize")  # said once


def test_every_error_is_a_soma_error_and_a_builtin():
    errors = [getattr(somatize, n) for n in somatize.__all__ if n.endswith("Error")]
    builtins = (ValueError, TypeError, OSError, LookupError, RuntimeError, ConnectionError)
    for error in errors:
        assert issubclass(error, somatize.SomaError)
        assert error is somatize.SomaError or issubclass(error, builtins), error
