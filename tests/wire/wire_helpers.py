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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
                 token: str | None = TOKEN, env: dict[str, str] | None = None):
        extra = {"SOMATIZE_TOKEN": token} if token else {}
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "somatize.worker", "--listen", listen, *args],
            env=env or child_env(**extra), stdout=subprocess.PIPE, stderr=self._log,
            stdin=subprocess.DEVNULL)
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
