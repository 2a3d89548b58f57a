"""Every error somatize defines crosses a process boundary as itself, with its fields:
pickled and unpickled, and raised in a task of a process pool started by spawn (the
way a federated client runs as a job elsewhere). Through a Ray task: tests/ray/
test_ray_errors.py."""

import concurrent.futures
import errno
import importlib
import inspect
import multiprocessing
import pickle
import pkgutil

import pytest

import somatize
from somatize import CycleError, Graph, Lost, Node, NodeError, SomaError, StateLost, StoreError

# A value for each field an error type takes, by the name of its argument. A new error
# type with a field of another name makes the test say which one to add here.
FIELDS = {
    "message": "what went wrong, and what to do instead",
    "node": "body",
    "host": "gpu",
    "kind": "RuntimeError",
    "nodes": ["body", "head"],
    "path": ["a", "b", "a"],
    "version": 3,
    "code": "AccessDenied",
    "text": 'Traceback (most recent call last):\n  File "net.py", line 1\nValueError: no\n',
    "what": "a symbolic link",
    "retried": True,
    "error": somatize.WireError("the actor restarted", host="gpu"),
}


def modules():
    """Every module of somatize that imports here; one whose optional dependency is
    missing is left out (its errors cannot reach a caller that lacks it either)."""
    found = []
    for info in pkgutil.walk_packages(somatize.__path__, "somatize."):
        if info.name.endswith("__main__"):
            continue
        try:
            found.append(importlib.import_module(info.name))
        except ImportError:
            continue
    return found


def below(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from below(sub)


def error_types():
    """SomaError and everything below it, wherever it is defined (every module is
    imported first, so none is missed), and every other exception somatize defines."""
    loaded = modules()
    found = {SomaError, *below(SomaError)}
    for module in loaded:
        found.update(value for value in vars(module).values()
                     if isinstance(value, type) and issubclass(value, BaseException)
                     and value.__module__.startswith("somatize"))
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


def made(cls):
    """An error of type ``cls`` with every field it takes given."""
    taken = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in taken):
        return cls(FIELDS["message"])
    missing = [p.name for p in taken if p.name not in FIELDS]
    assert not missing, (f"{cls.__qualname__} takes {missing}: give FIELDS a value for each, "
                         "so that this test can make one")
    return cls(**{p.name: FIELDS[p.name] for p in taken})


def same(a, b):
    """Whether two errors are the same error: type, text, arguments and fields (an
    OSError's errno and file names included), an error among the fields likewise."""
    if isinstance(a, BaseException):
        fields = ("errno", "strerror", "filename", "filename2") if isinstance(a, OSError) else ()
        return (type(a) is type(b) and str(a) == str(b) and a.args == b.args
                and all(getattr(a, f) == getattr(b, f) for f in fields)
                and vars(a).keys() == vars(b).keys()
                and all(same(v, vars(b)[k]) for k, v in vars(a).items()))
    return a == b


def test_the_walk_finds_errors_defined_outside_the_errors_module():
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in error_types()}
    assert {"somatize._errors.NodeError", "somatize._errors.Lost",
            "somatize.wire.protocol.OtherVersion", "somatize.store.bucket._Denied",
            "somatize.wire.transport.RemoteTraceback"} <= names


@pytest.mark.parametrize("cls", error_types(), ids=lambda cls: cls.__qualname__)
def test_every_error_type_round_trips_through_pickle_with_its_fields(cls):
    error = made(cls)
    if isinstance(error, SomaError):  # what is set after an error is made travels too
        error.facts = [{"fact": "failed", "node": "body"}]
        error.add_note("said on the way")
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert same(error, back), (vars(error), vars(back))


def test_an_oserror_keeps_its_errno_and_file_names():
    error = StoreError(errno.ENOENT, "no such object", "objects/ab", None, "objects/cd")
    back = pickle.loads(pickle.dumps(error))
    assert same(error, back)
    assert (back.errno, back.filename2, str(back)) == (errno.ENOENT, "objects/cd", str(error))


# -- raised in a task of a process pool -------------------------------------------------
class Broken(Node):
    def forward(self, x, ctx):
        raise ZeroDivisionError("broken on purpose")


def fails_in_a_walk():
    Graph.somatize(Broken().named("body")).forward(1)


def fails_closing_a_cycle():
    g = Graph.somatize(Broken().named("a") >> Broken().named("b"))
    g.edge("b", "a")


def loses(kind):
    if kind == "Lost":
        raise Lost("the output stayed on gpu", node="body", host="gpu")
    raise StateLost("gpu restarted", host="gpu", nodes=["body", "head"])


@pytest.fixture(scope="module")
def pool():
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        yield pool


def raised(future):
    with pytest.raises(SomaError) as caught:
        future.result(timeout=60)
    return caught.value


def test_a_node_error_raised_in_a_process_pool_reaches_the_caller_as_itself(pool):
    error = raised(pool.submit(fails_in_a_walk))
    assert type(error) is NodeError
    assert (error.node, error.host, error.kind) == ("body", None, "ZeroDivisionError")
    assert str(error) == "node 'body' (Broken) raised ZeroDivisionError: broken on purpose"


def test_a_cycle_raised_in_a_process_pool_keeps_its_path(pool):
    error = raised(pool.submit(fails_closing_a_cycle))
    assert type(error) is CycleError and error.path == ["a", "b", "a"]


@pytest.mark.parametrize("kind", ["Lost", "StateLost"])
def test_what_a_worker_lost_raised_in_a_process_pool_keeps_its_fields(pool, kind):
    error = raised(pool.submit(loses, kind))
    assert type(error).__name__ == kind and error.host == "gpu"
    assert error.node == "body" if kind == "Lost" else error.nodes == ["body", "head"]
