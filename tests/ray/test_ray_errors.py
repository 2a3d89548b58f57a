"""An error somatize raises in a Ray task (the way the README runs federated clients)
reaches the caller as its own type, fields and all, not as Ray's
UnserializableException. The pickling of every type: tests/test_errors.py."""

import pytest

from somatize import Graph, Lost, Node, NodeError


class Broken(Node):
    def forward(self, x, ctx):
        raise ZeroDivisionError("broken on purpose")


def fails_in_a_walk():
    Graph.somatize(Broken().named("body")).forward(1)


def loses():
    raise Lost("the output stayed on gpu", node="body", host="gpu")


@pytest.fixture(scope="module")
def task(cluster):
    return lambda function: cluster.remote(num_cpus=0, max_retries=0)(function).remote()


def test_a_node_error_raised_in_a_ray_task_reaches_the_caller_as_itself(cluster, task):
    with pytest.raises(NodeError) as caught:
        cluster.get(task(fails_in_a_walk), timeout=60)
    error = caught.value.cause  # Ray raises a subclass of both, around the error itself
    assert type(error) is NodeError
    assert (error.node, error.host, error.kind) == ("body", None, "ZeroDivisionError")
    assert str(error) == "node 'body' (Broken) raised ZeroDivisionError: broken on purpose"
    assert caught.value.node == "body"  # read through Ray's wrapper too


def test_lost_raised_in_a_ray_task_keeps_its_node_and_host(cluster, task):
    with pytest.raises(Lost) as caught:
        cluster.get(task(loses), timeout=60)
    assert type(caught.value.cause) is Lost
    assert (caught.value.node, caught.value.host) == ("body", "gpu")
