"""``python -m somatize.worker`` as a user runs it: what it prints, what it refuses,
how it ends, and TLS."""

import shutil
import signal
import subprocess
import sys

import pytest
from wire_helpers import TOKEN, child_env, standing  # noqa: F401  (a fixture)
from wire_nodes import Shout

from somatize import Graph, WireError, Worker
from somatize.worker import main


def run_worker(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "somatize.worker", *args], env=child_env(**env),
                          capture_output=True, text=True, timeout=30)


def test_listening_beyond_loopback_without_a_token_is_refused():
    done = run_worker("--listen", "0.0.0.0:0")
    assert done.returncode == 2 and done.stdout == ""
    assert "0.0.0.0:0" in done.stderr
    assert "SOMATIZE_TOKEN" in done.stderr and "--token-file" in done.stderr
    assert "--insecure" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_insecure_says_so_and_a_signal_ends_it_cleanly(standing, sig):
    worker = standing("--insecure", listen="0.0.0.0:0", token=None)
    assert worker.first_line.startswith("listening on 0.0.0.0:")
    with Worker.at(f"127.0.0.1:{worker.port}") as w1:  # a connection open as it ends
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": w1}) == "X"
        worker.signal(sig)
        assert worker.proc.wait(10) == 0
    assert "stopped (1 connection closed)" in worker.log()


def test_a_token_file_is_a_token(standing, tmp_path):
    path = tmp_path / "token"
    path.write_text("from-a-file\n")
    worker = standing("--token-file", str(path), token=None)
    with Worker.at(worker.addr, token="from-a-file") as w1:
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": w1}) == "X"


@pytest.mark.parametrize("args, said", [
    (["--listen", "nowhere"], "not an address"),
    (["--listen", "127.0.0.1:0", "--tls-cert", "c.pem"], "both --tls-cert and --tls-key"),
    (["--listen", "127.0.0.1:0", "--token-file", "/nonexistent/token"], "cannot read --token-file"),
    (["--listen", "127.0.0.1:0", "--timeout", "0"], "positive number"),
    (["--listen", "127.0.0.1:0", "--max-frame", "-1"], "Limits.frame"),
])
def test_bad_arguments_are_named(args, said, capsys):
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2 and said in capsys.readouterr().err


def test_a_port_in_use_is_said(standing):
    worker = standing()
    done = run_worker("--listen", worker.addr, SOMATIZE_TOKEN=TOKEN)
    assert done.returncode == 1 and worker.addr in done.stderr


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def test_tls_carries_the_same_protocol(standing, certificate):
    cert, key = certificate
    worker = standing("--tls-cert", cert, "--tls-key", key)
    g = Graph.somatize(Shout().at("w1"))
    with Worker.at(worker.addr, token=TOKEN, tls=cert) as w1:
        assert g.forward("secret", broker={"w1": w1}) == "SECRET"
        assert g.forward("again", broker={"w1": w1}) == "AGAIN"
    with pytest.raises(WireError):  # a client speaking plain TCP to it gets nowhere
        g.forward("x", broker={"w1": Worker.at(worker.addr, token=TOKEN, timeout=2)})
    with Worker.at(worker.addr, token=TOKEN, tls=cert) as w1:
        assert g.forward("still", broker={"w1": w1}) == "STILL"


def test_the_log_can_go_to_a_file(tmp_path):
    import os
    import subprocess
    import sys

    log = tmp_path / "worker.log"
    env = dict(os.environ, SOMATIZE_TOKEN="a-token-for-the-log-test-123456")
    proc = subprocess.Popen([sys.executable, "-m", "somatize.worker", "--listen",
                             "127.0.0.1:0", "--log", str(log)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("listening on ")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and err == ""
    said = log.read_text()
    assert "listening on 127.0.0.1:" in said and "stopped" in said
