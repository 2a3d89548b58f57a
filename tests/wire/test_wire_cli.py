"""``python -m somatize.worker`` as a user runs it: what it prints, what it refuses,
how it ends, and TLS."""

import shutil
import signal
import subprocess
import sys

import pytest
from wire_helpers import TOKEN, certificate, child_env, standing  # noqa: F401  (fixtures)
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
    (["--listen", "127.0.0.1:0", "--max-connections", "0"], "--max-connections is at least 1"),
    (["--listen", "127.0.0.1:0", "--max-connections", "4", "--max-unauthenticated", "5"],
     "between 1 and --max-connections (4)"),
])
def test_bad_arguments_are_named(args, said, capsys):
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2 and said in capsys.readouterr().err


def test_a_port_in_use_is_said(standing):
    worker = standing()
    done = run_worker("--listen", worker.addr, SOMATIZE_TOKEN=TOKEN)
    assert done.returncode == 1 and worker.addr in done.stderr


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


def test_a_certificate_that_does_not_verify_is_our_error_naming_the_host(standing, certificate):
    import ssl

    from somatize import Unauthorised

    cert, key = certificate
    worker = standing("--tls-cert", cert, "--tls-key", key)
    g = Graph.somatize(Shout().at("w1"))
    with pytest.raises(Unauthorised) as caught:  # the system's CAs never signed it
        g.forward("x", broker={"w1": Worker.at(worker.addr, token=TOKEN, tls=True, timeout=5)})
    error = caught.value
    assert isinstance(error, WireError) and not isinstance(error, ssl.SSLError)
    assert error.host == "w1" and worker.addr in str(error)
    assert "certificate does not verify" in str(error) and "tls=" in str(error)


def test_somatize_token_prints_a_fresh_token_a_worker_takes(standing):
    import base64

    made = [subprocess.run([sys.executable, "-m", "somatize", "token"], env=child_env(),
                           capture_output=True, text=True, timeout=30) for _ in range(2)]
    tokens = [done.stdout.strip() for done in made]
    assert all(done.returncode == 0 and done.stderr == "" for done in made)
    assert tokens[0] != tokens[1]
    assert len(base64.urlsafe_b64decode(tokens[0] + "=")) == 32  # 256 bits, URL-safe
    worker = standing(token=tokens[0])
    with Worker.at(worker.addr, token=tokens[0]) as w1:
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": w1}) == "X"
    log = worker.wait_log("closed by the client")  # so every line before it is written
    assert "the token is only" not in log  # long enough not to be warned about


def test_a_short_token_is_served_and_warned_about(standing):
    worker = standing(token="hunter2")
    worker.wait_log("the token is only 7 bytes long")
    with Worker.at(worker.addr, token="hunter2") as w1:
        assert Graph.somatize(Shout().at("w1")).forward("x", broker={"w1": w1}) == "X"
