"""One local Ray cluster for the whole session: starting one costs seconds, so every
test shares it. Without Ray (or torch) the directory is left out, and the header of
the run says why."""

import importlib.util

import pytest
from ray_helpers import cluster_env

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("torch") is not None

if not HAS_RAY:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if not HAS_RAY:
        return "tests/ray: skipped, ray or torch is not installed (pip install 'somatize[ray,torch]')"
    return None


@pytest.fixture(scope="session")
def cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": cluster_env()})
    yield ray
    ray.shutdown()


@pytest.fixture
def on_ray(cluster):
    """Declares Ray workers (as Worker.on_ray does) and closes them after the test."""
    from somatize import Worker

    made = []

    def declare(**options):
        options.setdefault("num_cpus", 0)
        worker = Worker.on_ray(mode="network", send=["raynets"], **options)
        made.append(worker)
        return worker

    yield declare
    for worker in made:
        worker.close()
