"""The store's fixtures: the bucket's, defined in s3server.py (a name tests can import),
and a directory nobody may write, made so for real."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import (  # noqa: F401  (pytest finds fixtures by name)
    credentials,
    forgetful_endpoint,
    iam_endpoint,
    lossy_endpoint,
    s3_endpoint,
)

NOBODY = 65534


def _quiet(*command: object) -> bool:
    return subprocess.run([str(c) for c in command], capture_output=True,
                          check=False).returncode == 0


@contextlib.contextmanager
def _chmodded(where: Path) -> Iterator[tuple[Path, dict]]:
    """Not root: taking the write bits away is enough."""
    paths = [where, *where.rglob("*")]
    modes = {path: path.stat().st_mode for path in paths}
    for path in sorted(paths, reverse=True):  # the deepest first
        path.chmod(modes[path] & ~0o222)
    try:
        yield where, {}
    finally:
        for path in paths:
            path.chmod(modes[path])


@contextlib.contextmanager
def _as_nobody(where: Path) -> Iterator[tuple[Path, dict]]:
    """Root that may not mount: a copy that nobody may write, read as user nobody."""
    as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        runs = subprocess.run([sys.executable, "-c", "import somatize"], capture_output=True,
                              check=False, timeout=60, **as_nobody).returncode == 0
    except OSError:
        runs = False
    if not runs:
        pytest.skip(f"running as root without mount, and user nobody cannot run "
                    f"{sys.executable} with somatize: nothing here can make a store that "
                    "this test's reader may not write")
    home = Path(tempfile.mkdtemp(prefix="somatize-read-only-"))
    home.chmod(0o755)
    copy = home / where.name
    shutil.copytree(where, copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o444)
    try:
        yield copy, as_nobody
    finally:
        shutil.rmtree(home)


@pytest.fixture
def unwritable():
    """``unwritable(store_directory)`` is a context manager that makes a store unwritable
    for real and yields ``(where to read it, what subprocess.Popen needs to read it
    there)``: chmod when not root; as root, a read-only bind mount, or else a copy read
    as user nobody (root writes through any chmod)."""

    @contextlib.contextmanager
    def made(where: Path) -> Iterator[tuple[Path, dict]]:
        if os.geteuid() != 0:
            with _chmodded(where) as seen:
                yield seen
            return
        target = where.with_name(where.name + "-read-only")
        target.mkdir()
        mounted = _quiet("mount", "--bind", where, target)
        if mounted and _quiet("mount", "-o", "remount,bind,ro", target):
            try:
                yield target, {}
            finally:
                _quiet("umount", target)
                target.rmdir()
            return
        if mounted:
            _quiet("umount", target)
        target.rmdir()
        with _as_nobody(where) as seen:
            yield seen

    return made
