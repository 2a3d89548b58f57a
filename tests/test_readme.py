"""The README runs as printed: every fenced python and bash block, parsed out of
README.md, is run here, python in a fresh interpreter and bash with ``bash -e``, in a
fresh folder that holds the clone's ``examples/`` (as a link), the way a reader at the
clone's root runs them. A block whose first line says ``# continues the block above``
(or ``# continues the tour``) runs after what it continues: as one program for python,
in the same folder for bash.

Where a block speaks of a machine this one is not, only the address changes, by one
rule (``ADDRESSES``): ``node3:7000`` and ``0.0.0.0:7000`` become the loopback address of
a real ``somatize worker``, the one the README's own worker block starts, and
``http://127.0.0.1:9000`` becomes a real S3 server's (moto's). Slurm's blocks run where
``sbatch`` is, and are skipped, saying so, elsewhere; the Ray block runs on the session's
Ray cluster in tests/ray/test_ray_readme.py; the make targets are make's own (the demo's
work is tests/test_demo.py's). ``test_every_block_is_run_somewhere`` holds that list to
the README, so a new block without a test fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import somatize

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SRC = os.path.dirname(os.path.dirname(somatize.__file__))


@dataclass(frozen=True)
class Block:
    section: str  # the ## heading it is under
    language: str  # what its fence says: "python", "bash", or "" for none
    text: str
    line: int  # where its fence opens in README.md

    @property
    def key(self) -> tuple[str, str, int]:
        """(section, language, n): the n-th block of that language in that section."""
        same = [b for b in BLOCKS if b.section == self.section and b.language == self.language]
        return self.section, self.language, same.index(self)


def blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown``, exactly as printed."""
    found, section, fence = [], "", None
    for number, line in enumerate(markdown.splitlines(keepends=True), 1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif line.startswith("```"):
                fence, language, body = number, line[3:].strip(), []
        elif line.startswith("```"):
            found.append(Block(section, language, "".join(body), fence))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"README.md: the fence opened at line {fence} is never closed"
    return found


BLOCKS = blocks(README.read_text())
TOUR = "A tour in twenty lines"
WATCHING = "Watching runs live, and the trackers you already use"
TRAINING = "Training, as the reference pages write it"
SURVIVING = "A run that survives its machine"
WORKER = "A worker on another machine"
BUCKET = "A store on a bucket"
FEDERATED = "Federated rounds, and the same on Slurm"
SHARED = "Many data holders, one server half"

# Which test runs each block; the test below holds this to the README.
RUN_BY = {
    ("Two commands", "", 0): "make itself (running make test from a test would recurse)",
    (TOUR, "python", 0): "test_the_tour_learns_is_healthy_and_its_commands_read_it",
    (TOUR, "bash", 0): "test_the_tour_learns_is_healthy_and_its_commands_read_it",
    (WATCHING, "bash", 0): "test_the_tour_learns_is_healthy_and_its_commands_read_it",
    (WATCHING, "python", 0): "test_the_tour_learns_is_healthy_and_its_commands_read_it",
    (TRAINING, "python", 0): "test_training_on_a_worker_and_the_run_that_survives",
    (SURVIVING, "python", 0): "test_training_on_a_worker_and_the_run_that_survives",
    (SURVIVING, "bash", 0): "test_the_slurm_blocks_run_where_slurm_is",
    (WORKER, "bash", 0): "test_training_on_a_worker_and_the_run_that_survives",
    ("On a Ray cluster", "python", 0): "tests/ray/test_ray_readme.py (on the session's cluster)",
    (BUCKET, "python", 0): "test_the_bucket_block",
    (FEDERATED, "bash", 0): "test_federated_rounds_on_this_machine",
    (FEDERATED, "bash", 1): "test_the_slurm_blocks_run_where_slurm_is",
    (SHARED, "bash", 0): "test_many_clients_share_one_server_half",
}


def block(section: str, language: str, n: int = 0) -> Block:
    return next(b for b in BLOCKS if b.key == (section, language, n))


def program(chosen: Block) -> str:
    """The block, after the blocks it says it continues (python only)."""
    first = chosen.text.splitlines()[0] if chosen.text else ""
    if first.startswith("# continues the block above"):
        earlier = [b for b in BLOCKS if b.language == chosen.language and b.line < chosen.line]
        return program(earlier[-1]) + chosen.text
    if first.startswith("# continues the tour"):
        return program(block(TOUR, chosen.language)) + chosen.text
    return chosen.text


def addressed(text: str, worker: str | None = None, bucket: str | None = None) -> str:
    """``text`` with the README's addresses of other machines replaced by this one's."""
    for written, here in ADDRESSES(worker, bucket).items():
        if here is not None:
            text = text.replace(written, here)
    return text


def ADDRESSES(worker: str | None, bucket: str | None) -> dict[str, str | None]:  # noqa: N802
    return {"node3:7000": worker, "0.0.0.0:7000": worker, "http://127.0.0.1:9000": bucket}


def environment(**more: str) -> dict[str, str]:
    """This interpreter's somatize and commands first, as an installed one would be."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": SRC, "PATH": path, **more}


def folder(tmp_path: Path) -> Path:
    """A fresh folder to run blocks in, with the clone's examples/ where a reader has them."""
    where = tmp_path / "reader"
    where.mkdir()
    (where / "examples").symlink_to(ROOT / "examples")
    return where


def run(language: str, text: str, where: Path, timeout: float = 240, **env: str):
    argv = [sys.executable, "-c", text] if language == "python" else ["bash", "-e", "-c", text]
    done = subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=timeout,
                          env=environment(**env))
    assert done.returncode == 0, f"{language} block failed:\n{text}\n{done.stdout}\n{done.stderr}"
    return done


def test_every_block_is_run_somewhere():
    keys = [b.key for b in BLOCKS]
    assert len(keys) == len(set(keys))
    unclaimed = [(b.line, b.key) for b in BLOCKS if b.key not in RUN_BY]
    assert not unclaimed, f"README.md has blocks no test runs: {unclaimed}; add each to RUN_BY"
    gone = [key for key in RUN_BY if key not in keys]
    assert not gone, f"RUN_BY names blocks the README no longer has: {gone}"
    assert {b.language for b in BLOCKS} == {"python", "bash", ""}
    assert [b.section for b in BLOCKS if b.language == ""] == ["Two commands"]


def test_the_blocks_are_parsed_exactly_as_printed():
    tour, lines = block(TOUR, "python"), README.read_text().splitlines(keepends=True)
    assert lines[tour.line - 1] == "```python\n"
    length = len(tour.text.splitlines())
    assert "".join(lines[tour.line:tour.line + length]) == tour.text
    assert lines[tour.line + length] == "```\n"
    assert program(block(WATCHING, "python")).startswith(tour.text)
    assert program(block(SURVIVING, "python")).startswith(block(TRAINING, "python").text)
    assert addressed('Worker.at("node3:7000")', worker="127.0.0.1:5") == 'Worker.at("127.0.0.1:5")'


@pytest.mark.slow
def test_the_tour_learns_is_healthy_and_its_commands_read_it(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("plotly")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    where = folder(tmp_path)
    done = run("python", program(block(WATCHING, "python")), where)  # the tour, then more
    loss = float(done.stdout.split()[0])  # what the tour printed
    assert loss < 0.02, done.stdout  # it learned: its target's variance is 0.125
    said = run("bash", block(TOUR, "bash").text, where).stdout
    runs = {line.split()[0]: line.split() for line in said.splitlines()[2:4]}
    assert runs["tour"][1] == "50" and float(runs["tour"][-1]) == pytest.approx(loss)
    assert "run tour: 50 measured steps" in said and "\nno findings\n" in said, said
    assert (where / "report.html").read_text().startswith("<!DOCTYPE html>")
    exported = run("bash", block(WATCHING, "bash").text, where)
    assert "logged run tour as MLflow run" in exported.stdout, exported.stdout
    assert "warning" not in exported.stderr.lower(), exported.stderr
    assert sorted(p.name for p in where.iterdir()) == [
        "examples", "mlflow-artifacts", "mlflow.db", "report.html", "runs", "tb"]  # no mlruns/
    assert {p.name for p in (where / "tb").iterdir()} == {"tour", "live"}


@pytest.mark.slow
def test_training_on_a_worker_and_the_run_that_survives(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("msgpack")
    where, home = folder(tmp_path), tmp_path / "home"
    home.mkdir()
    from s3server import answers, free_port

    port = free_port()
    log = open(tmp_path / "worker.log", "w")
    # The README's worker block, as printed but for its address: a real worker, on
    # loopback, holding the token it made in this HOME.
    worker = subprocess.Popen(
        ["bash", "-e", "-c", addressed(block(WORKER, "bash").text, worker=f"127.0.0.1:{port}")],
        cwd=where, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=environment(HOME=str(home)))
    try:
        deadline = time.monotonic() + 60
        while not answers(port):
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker never listened"
            time.sleep(0.1)
        token = (home / ".somatize-token").read_text().strip()
        assert (home / ".somatize-token").stat().st_mode & 0o777 == 0o600 and len(token) >= 43
        code = addressed(program(block(SURVIVING, "python")), worker=f"127.0.0.1:{port}")
        run("python", code, where, SOMATIZE_TOKEN=token)  # the copied secret
        from somatize.store import Store

        saved = Store(where / "runs").resolve("run/ckpt")
        assert saved is not None
        run("python", code, where, SOMATIZE_TOKEN=token)  # started again: it goes on from there
        assert Store(where / "runs").resolve("run/ckpt") is not None
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        log.close()


def test_the_bucket_block(s3_endpoint, credentials, tmp_path):
    pytest.importorskip("boto3")
    from s3server import make_bucket

    make_bucket(s3_endpoint, "my-bucket")  # what an administrator does before
    code = addressed(block(BUCKET, "python").text, bucket=s3_endpoint)
    assert code != block(BUCKET, "python").text
    assert run("python", code, folder(tmp_path)).stdout == "{'from': 'a bucket'}\n"


@pytest.mark.slow
def test_federated_rounds_on_this_machine(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("submitit")
    done = run("bash", block(FEDERATED, "bash").text, folder(tmp_path), timeout=290)
    assert done.stdout.count("4 clients x 3 rounds via processes") == 1, done.stdout
    assert "via submitit" in done.stdout


def test_many_clients_share_one_server_half(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    done = run("bash", block(SHARED, "bash").text, folder(tmp_path), timeout=290)
    assert "2 clients, parallel, 40 steps each, one worker" in done.stdout, done.stdout
    assert "mean accuracy" in done.stdout, done.stdout


@pytest.mark.parametrize("key", [(SURVIVING, "bash", 0), (FEDERATED, "bash", 1)])
def test_the_slurm_blocks_run_where_slurm_is(key, tmp_path):
    if shutil.which("sbatch") is None:
        pytest.skip("needs Slurm (sbatch is not on PATH): these blocks are for a cluster")
    assert os.path.isdir("/shared"), "the blocks keep their store in /shared, which every node mounts"
    run("bash", block(*key).text, folder(tmp_path), timeout=290)


@pytest.mark.slow
def test_make_docs_builds_a_site_that_needs_no_network(tmp_path):
    """What `make docs` runs; the site it leaves loads nothing from elsewhere, and its
    code is coloured by the stylesheet that travels with it."""
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    site = tmp_path / "site"
    done = subprocess.run([mkdocs, "build", "-d", str(site)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=environment())
    assert done.returncode == 0, done.stderr
    pages = {page: page.read_text() for page in site.rglob("*.html")}
    fetched = {found for text in pages.values()
               for found in re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', text)}
    assert not fetched, f"the built site loads {sorted(fetched)} from the network"
    assert any('<span class="k">' in text for text in pages.values())  # coloured, here
    assert (site / "css" / "pygments.css").read_text().count(".highlight") > 20


def test_the_set_up_the_tests_need_is_said_where_a_newcomer_reads():
    """make test's browser tests need Chromium, which pip cannot bring: the README says
    so, naming the package .ci/run installs."""
    said = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    ci = (ROOT / ".ci" / "run").read_text()
    installed = re.search(r"apt-get install -y -qq (\w+)", ci).group(1)
    assert f"apt-get install {installed}" in said and "skipped" in said


def test_the_first_screen_says_how_to_reach_what_make_installed():
    """make puts the package and its command in a virtualenv, which a new shell does not
    see: the README's first screen says how to activate it, or to call the command by
    its path, naming the folder the Makefile makes and the command pyproject installs."""
    first_screen = "\n".join(README.read_text().splitlines()[:40])
    venv = re.search(r"^VENV\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    command = re.search(r"\[project\.scripts\]\n(\w+) =", (ROOT / "pyproject.toml").read_text()).group(1)
    assert f". {venv}/bin/activate" in first_screen
    assert f"{venv}/bin/{command} " in first_screen


def test_the_first_example_runs_as_its_docstring_says():
    """examples/first.py names the command that runs it, with the interpreter make
    installs (``make demo`` runs the demo, not this): that command, with this
    interpreter in place of .venv's, runs it from the clone's root."""
    said = re.search(r"^\s+(\S+) (examples/first\.py)", (ROOT / "examples" / "first.py").read_text(), re.M)
    assert said.group(1) == ".venv/bin/python"
    done = subprocess.run([sys.executable, said.group(2)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
