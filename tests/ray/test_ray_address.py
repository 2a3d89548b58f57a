"""A cluster started the way a user starts one (``ray start --head``), and a client that
connects to it by address and runs a slice there."""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from ray_helpers import cluster_env

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")

CLIENT = textwrap.dedent("""
    import sys
    import ray
    from somatize import Graph, Node, Worker

    class Twice(Node):  # defined here, in __main__: it travels by value
        def forward(self, x, ctx):
            return x * 2

    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    with Worker.on_ray(mode="network", num_cpus=1) as there:
        g = Graph.somatize(Twice().at("far"))
        print("answer", g.forward(21, broker={"far": there}), flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(RAY is None, reason="the ray command is not on PATH")
def test_a_client_reaches_a_cluster_started_with_ray_start_by_its_address():
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's sockets live in it
    # Both ends by token, as a cluster on a shared network should be: the token handed
    # to both ends as Ray reads it (newer Rays refuse token mode without one and no
    # longer write one for ``ray start``; older ones ignore both variables).
    env = {**os.environ, **cluster_env(), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # --block keeps the head in the foreground, so ending this one process ends the
    # cluster it started, and nobody else's (``ray stop`` would end every one here).
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
         f"--temp-dir={temp}", "--block"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while not _listening(port):
            assert head.poll() is None, head.stdout.read()
            assert time.monotonic() < deadline, "the head did not listen within 90 s"
            time.sleep(0.5)
        client = subprocess.run([sys.executable, "-c", CLIENT, address], env=env,
                                capture_output=True, text=True, timeout=180)
        assert client.returncode == 0, client.stderr[-3000:]
        assert "answer 42" in client.stdout
    finally:
        head.terminate()
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
