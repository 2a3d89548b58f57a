"""examples/federated.py --via ray: the clients as Ray tasks, gathering through a folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ray_helpers import cluster_env

import somatize.torch  # noqa: F401  (the codec the store reads tensors back with)
from somatize.store import Store

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_example_runs_its_clients_as_ray_tasks_on_a_cluster_by_address(cluster, tmp_path):
    address = cluster.get_runtime_context().gcs_address  # the session's: a user's cluster
    env = {**os.environ, **cluster_env(), "RAY_AUTH_MODE": "token"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "federated.py"), "--via", "ray",
         "--ray-address", address, "--clients", "2", "--rounds", "2", "--steps", "3",
         "--asking", "0.05", "--store", str(tmp_path / "s"), "--run", "demo"],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "via ray" in done.stdout
    assert "every client ends with the same weights: yes" in done.stdout
    store = Store(tmp_path / "s")
    finals = [store.recall(f"fed/demo/final/{k}") for k in range(2)]
    last = store.recall("fed/demo/1/average")
    assert all(torch.equal(f[n][k], last[n][k]) for f in finals for n in last for k in last[n])
