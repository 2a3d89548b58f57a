"""Real workers for the wire tests: ``python -m somatize.worker`` processes on loopback.

Workers import ``wire_nodes`` in mode='project', so its folder (``importable/``, and
not this one: a class defined in a test module must be one a worker cannot import) is
put on the PYTHONPATH every child inherits, from the moment this module is imported.
Not a conftest.py: test folders without packages share one ``conftest`` module name,
and a second one would shadow whatever another folder's tests import from theirs.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from somatize.wire.channel import Channel
from somatize.wire.protocol import (
    HANDSHAKE,
    VERSION,
    Limits,
    Keyed,
    derive_key,
    encode,
    new_nonce,
    proof,
    connection_key,
)

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
IMPORTABLE = HERE / "importable"
sys.path.insert(0, str(IMPORTABLE))
TOKEN = "a-token-for-the-wire-tests-" + "7" * 16


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SOMATIZE_TOKEN", None)
    env.pop("SOMATIZE_TIMEOUT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(IMPORTABLE)])
    env.update(extra)
    return env


_before = os.environ.get("PYTHONPATH")
os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), str(IMPORTABLE)] + ([_before] if _before else []))


class Standing:
    """A worker started from the command line, as a user would."""

    def __init__(self, log_path: Path, *args: str, listen: str = "127.0.0.1:0",
                 token: str | None = TOKEN, env: dict[str, str] | None = None,
                 files: int | None = None):
        extra = {"SOMATIZE_TOKEN": token} if token else {}
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "somatize.worker", "--listen", listen, *args],
            env=env or child_env(**extra), stdout=subprocess.PIPE, stderr=self._log,
            stdin=subprocess.DEVNULL, preexec_fn=None if files is None else _files(files))
        self.first_line = read_line(self.proc, 30)
        assert self.first_line.startswith("listening on "), (self.first_line, self.log())
        self.addr = self.first_line.split()[-1]
        self.port = int(self.addr.rsplit(":", 1)[1])

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return self.log()
            time.sleep(0.02)
        raise AssertionError(f"{text!r} never appeared in the worker's log:\n{self.log()}")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def cpu_seconds(self) -> float:
        """User and system time the worker has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def resident(self) -> int:
        """The worker's resident memory, in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread has stopped: the thread that takes the
        signal stops the others, and until it is scheduled they go on answering."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while time.monotonic() < deadline:
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
            if all(state in "Tt" for state in states):
                return
            time.sleep(0.01)
        raise AssertionError(f"the worker did not stop: its threads are {states}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


def _files(limit: int):
    def limited() -> None:  # runs in the child, before exec: ulimit -n LIMIT
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return limited


def raw(addr: str, timeout: float = 5) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def frame_bytes(kind: str, header: dict | None = None, buffers=(), keyed=None) -> bytes:
    return b"".join(bytes(p) for p in encode(kind, header, list(buffers), keyed))


def hello_bytes() -> bytes:
    return frame_bytes("hello", {"v": VERSION, "n": new_nonce(), "t": 5.0})


def authenticated(addr: str, token: bytes = TOKEN.encode()) -> tuple[socket.socket, Channel, list, dict]:
    """A hand-made client: the handshake done with the protocol's own pieces, every
    byte it sent kept (so a test can send them again), and the worker's welcome."""
    sock = raw(addr)
    channel = Channel(sock, Limits())
    sent: list[bytes] = []
    client_nonce = new_nonce()
    sent.append(frame_bytes("hello", {"v": VERSION, "n": client_nonce, "t": 5.0}))
    sock.sendall(sent[-1])
    challenge = channel.recv(HANDSHAKE)
    worker_nonce = challenge.header["n"]
    key = derive_key(token, challenge.header["s"])
    sent.append(frame_bytes("proof", {"p": proof(key, b"client", client_nonce, worker_nonce)}))
    sock.sendall(sent[-1])
    channel.keyed = Keyed(connection_key(key, client_nonce, worker_nonce), b"C")
    welcome = channel.recv(HANDSHAKE)
    assert welcome.kind == "welcome"
    assert welcome.header["p"] == proof(key, b"worker", client_nonce, worker_nonce)
    return sock, channel, sent, welcome.header


def dropped(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the worker closed this connection (reading until it does)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    sock.close()
    return True


@pytest.fixture(scope="session")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost, and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    fd = proc.stdout.fileno()
    said = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in said and time.monotonic() < deadline:
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 1)
            if not chunk:
                break
            said += chunk
    return said.decode()


@pytest.fixture
def standing(tmp_path):
    """Starts command-line workers; every one is stopped after the test."""
    started: list[Standing] = []
    count = iter(range(100))

    def start(*args: str, **kwargs) -> Standing:
        worker = Standing(tmp_path / f"worker-{next(count)}.log", *args, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
