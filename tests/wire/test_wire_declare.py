"""Declaring workers and brokers: what is refused at once, and how children start and end."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from wire_helpers import child_env
from wire_nodes import Add, Shout

from somatize import Broker, DeclarationError, Graph, WireError, Worker


@pytest.mark.parametrize("make, said", [
    (lambda: Worker.at("node3"), "HOST:PORT"),
    (lambda: Worker.at("node3:99999"), "HOST:PORT"),
    (lambda: Worker.at("node3:7000", mode="cloud"), "'project' or 'network'"),
    (lambda: Worker.at("node3:7000", send=["pkg"]), "mode='network'"),
    (lambda: Worker.at("node3:7000", mode="network", send="pkg"), "list of module names"),
    (lambda: Worker.at("node3:7000", timeout=0), "positive number"),
    (lambda: Worker.at("node3:7000", tls=42), "ssl.SSLContext"),
    (lambda: Worker(42), "an address"),
    (lambda: Worker.generic(python="/nonexistent/python"), "cannot start"),
    (lambda: Broker({"w1": "node3:7000"}), "Worker.at"),
    (lambda: Broker({"not a host": Worker.at("node3:7000")}), "not a host name"),
])
def test_bad_declarations_are_refused_by_name(make, said):
    with pytest.raises(DeclarationError, match=said):
        make()


def test_declaring_opens_nothing_and_ipv6_addresses_parse():
    worker = Worker.at("[::1]:7000")
    assert worker._link.channel is None and worker._target == ("::1", 7000)
    assert "[::1]:7000" in repr(worker)


def test_network_mode_names_a_module_it_cannot_import():
    worker = Worker.at("127.0.0.1:9", mode="network", send=["no_such_module_here"])
    with pytest.raises(DeclarationError, match="no_such_module_here"):
        worker.packed({"a": Add(1)})


def test_packed_is_kind_id_and_bytes_and_the_same_nodes_pack_the_same():
    worker = Worker.at("127.0.0.1:9")
    kind, ident, blob = worker.packed({"a": Add(1)})
    assert kind == "pickle" and ident.startswith("sha256:") and isinstance(blob, bytes)
    assert worker.packed({"a": Add(1)}) == (kind, ident, blob)
    assert Worker.at("127.0.0.1:9", mode="network").packed({"a": Add(1)})[0] == "cloudpickle"


def test_a_node_defined_in_main_is_refused_in_project_mode():
    script = textwrap.dedent("""
        from somatize import DeclarationError, Node, Worker
        class Mine(Node):
            def forward(self, x, ctx):
                return x
        try:
            Worker.at("127.0.0.1:9").packed({"mine": Mine()})
        except DeclarationError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True,
                          text=True, timeout=60, check=True)
    assert "'mine'" in done.stdout and "__main__" in done.stdout and "mode='network'" in done.stdout


def test_spawn_takes_any_child_that_says_where_it_listens():
    argv = [sys.executable, "-c", "from somatize.worker import main; main(['--listen', '127.0.0.1:0'])"]
    with Worker.spawn(argv) as worker:
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": worker}) == "X"


@pytest.mark.parametrize("code, said", [
    ("print('hello there', flush=True); import time; time.sleep(30)", "first said b'hello there'"),
    ("import sys; sys.exit(3)", "exited with code 3"),
])
def test_a_child_that_does_not_listen_is_named(code, said):
    with Worker.spawn([sys.executable, "-c", code]) as worker:
        with pytest.raises(WireError, match=said) as caught:
            Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": worker})
    assert caught.value.host == "w1"


def test_one_wire_serves_many_threads_at_once():
    with Worker.generic() as worker:
        broker = Broker.embedded({"w1": worker})
        g = Graph.somatize(Add(1).at("w1") >> Add(1))
        results: dict[int, list[int]] = {}

        def run(k: int) -> None:
            results[k] = [g.forward(k * 100 + i, broker=broker) for i in range(10)]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert results == {k: [k * 100 + i + 2 for i in range(10)] for k in range(4)}


@pytest.mark.parametrize("ending", ["exits", "is killed"])
def test_children_never_outlive_their_client(ending):
    script = textwrap.dedent("""
        import sys
        from somatize import Worker
        w = Worker.generic()
        w.address("w1")
        print(w._child.pid, flush=True)
        sys.stdin.readline()
    """)
    client = subprocess.Popen([sys.executable, "-c", script], env=child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child = int(client.stdout.readline())
        assert alive(child)
        if ending == "exits":
            client.stdin.write(b"\n")
            client.stdin.flush()
        else:
            client.kill()
        client.wait(10)
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(child):
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the worker outlived its client, which {ending}")
    finally:
        client.kill()
        client.stdin.close()
        client.stdout.close()
        client.wait(5)


def alive(pid: int) -> bool:
    """Whether a process runs; a zombie waiting for whoever adopted it does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_spawned_worker_keeps_its_everyday_lines_out_of_this_terminal(capfd, tmp_path):
    g = Graph.somatize(Shout().at("w1"))
    with Worker.generic() as quiet:
        assert g.forward("hi", broker={"w1": quiet}) == "HI"
    with Worker.generic(verbose=True) as loud:
        assert g.forward("hi", broker={"w1": loud}) == "HI"
    said = capfd.readouterr().err
    assert said.count("ran in") == 1 and said.count("authenticated in") == 1  # the loud one
    log = tmp_path / "worker.log"
    with Worker.generic(log=log) as logged:
        assert g.forward("hi", broker={"w1": logged}) == "HI"
    assert "ran in" not in capfd.readouterr().err
    assert "slice ['shout'] ran in" in log.read_text() and "listening on" in log.read_text()


def test_on_ray_loads_its_layer_by_name_and_says_what_to_install_without_ray():
    """The wire never imports ``somatize.ray`` (it sits above it), yet ``on_ray`` works
    with nothing but the wire imported; without Ray it names the extra to install."""
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'ray':
                    raise ImportError('blocked for this test')
        sys.meta_path.insert(0, Block())
        from somatize.wire import Worker
        assert 'somatize.ray' not in sys.modules
        try:
            Worker.on_ray(num_gpus=1)
        except ImportError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Worker.on_ray needs the 'ray' extra: pip install 'somatize[ray]'" in done.stdout
