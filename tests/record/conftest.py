"""The record's fixtures: a disk that can be filled for real."""

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest


class Disk:
    """A directory whose disk fills up for real. ``how`` is ``"tmpfs"`` (a 4 MiB tmpfs,
    mounted as root, filled by ``fill`` until it answers ENOSPC) or ``"rlimit"`` (where
    a tmpfs cannot be mounted: the writing process itself lowers its RLIMIT_FSIZE to 0,
    so the kernel refuses its writes with EFBIG)."""

    def __init__(self, where: Path, how: str):
        self.where, self.how = where, how
        self.filler = where / "filler"

    def fill(self) -> None:
        if self.how != "tmpfs":
            return
        handle = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        chunk = bytes(1 << 16)
        try:
            while True:
                try:
                    os.write(handle, chunk)  # the last one takes what room there is
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    return
        finally:
            os.close(handle)

    def free(self) -> None:
        if self.filler.exists():
            self.filler.unlink()


@pytest.fixture
def full_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                                 capture_output=True, check=False).returncode == 0
        if mounted:
            try:
                yield Disk(where, "tmpfs")
            finally:
                subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
            return
    yield Disk(where, "rlimit")
