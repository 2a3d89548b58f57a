"""The directory store: the shared contract, then what only files on a disk can show."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from contract import ODD_NAMES, StoreContract

import somatize
from somatize import CorruptObject, StoreError
from somatize.record import Recorder
from somatize.store import DirectoryBackend, Store
from somatize.store import _files, local
from somatize.store.local import STALE_AFTER, _components

SRC = str(Path(somatize.__file__).resolve().parent.parent)
DIGEST_OF_X = "sha256:" + hashlib.sha256(b"x").hexdigest()


class TestDirectoryStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return Store(tmp_path / "s")

    def reopen(self, store):
        return Store(store.where)


class TestDirectoryStoreWalking(StoreContract):
    """The same, read the way a kernel without openat2 makes it: directory by directory."""

    @pytest.fixture
    def store(self, tmp_path, monkeypatch):
        monkeypatch.setattr(local, "_strict", [None])
        return Store(tmp_path / "s")

    def reopen(self, store):
        return Store(store.where)


@pytest.fixture(params=["openat2", "walk"])
def reading(request, monkeypatch):
    """Each way a directory store reads one file: openat2 where Linux has it, and the
    walk through each directory that it falls back to."""
    if request.param == "walk":
        monkeypatch.setattr(local, "_strict", [None])
    elif _files.strict_opener() is None:
        pytest.skip("this kernel offers no openat2, so only the walk reads here")
    return request.param


class TestDirectoryStoreNotDurable(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return Store(tmp_path / "s", durable=False)

    def reopen(self, store):
        return Store(store.where, durable=False)


def python(code: str, *args: str, **popen: object) -> subprocess.Popen:
    """Starts ``code`` in a fresh interpreter that can import this checkout's somatize."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            **popen)


def object_file(store: Store, digest: str) -> Path:
    (path,) = Path(store.where, "objects").rglob(digest.removeprefix("sha256:"))
    return path


# -- what the bytes on disk are allowed to do


def test_a_flipped_byte_is_corruption_not_data(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.put(b"precious " * 1000)
    path = object_file(store, digest)
    path.chmod(0o644)
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(CorruptObject) as caught:
        store.get(digest)
    assert digest in str(caught.value) and str(path) in str(caught.value)
    assert isinstance(caught.value, StoreError) and isinstance(caught.value, ValueError)
    store.bind("n", digest)  # the object is there, only wrong: get says so, bind does not
    with pytest.raises(CorruptObject):
        store.recall("n")
    path.unlink()
    assert store.get(digest) is None
    assert store.put(b"precious " * 1000) == digest
    assert store.get(digest) == b"precious " * 1000


def test_a_truncated_object_is_corruption(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.put(b"0123456789")
    path = object_file(store, digest)
    path.chmod(0o644)
    path.write_bytes(b"01234")
    with pytest.raises(CorruptObject, match=digest):
        store.get(digest)


def test_recall_of_a_name_whose_object_is_gone_names_both(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.keep("run/x", [1, 2])
    object_file(store, digest).unlink()
    with pytest.raises(StoreError) as caught:
        store.recall("run/x")
    assert "'run/x'" in str(caught.value) and digest in str(caught.value)
    assert store.resolve("run/x").digest == digest


def test_putting_bytes_already_kept_does_not_rewrite_them(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.put(b"once")
    before = os.stat(object_file(store, digest))
    time.sleep(0.01)
    store.put(b"once")
    after = os.stat(object_file(store, digest))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_a_garbled_name_record_is_an_error_naming_the_name(tmp_path):
    store = Store(tmp_path / "s")
    store.bind("run/x", store.put(b"x"))
    (record,) = [p for p in Path(store.where, "names").rglob("*") if p.is_file()]
    record.write_bytes(b'{"digest": "sha256:nope"')
    with pytest.raises(CorruptObject, match="'run/x'.*bind the name again"):
        store.resolve("run/x")
    with pytest.warns(UserWarning, match="'run/x'"):  # listed without it: see below
        assert store.bound() == []


def test_what_is_not_a_name_in_the_directory_is_not_listed(tmp_path):
    store = Store(tmp_path / "s")
    store.bind("real", store.put(b"x"))
    names = Path(store.where, "names")
    for stray in (".DS_Store", "A.n", "%2F.n", "..n", "x.txt", "%FF.n"):
        (names / stray).write_bytes(b"{}")
    (names / "dir.d").mkdir()
    (names / "dir.d" / "%41%.n").write_bytes(b"{}")
    (Path(store.where, "tmp") / "123-half-written").write_bytes(b'{"digest"')
    assert [b.name for b in store.bound()] == ["real"]


def test_long_names_really_are_longer_than_any_path_the_os_takes(tmp_path):
    # The contract binds these; this checks it thereby exercises the long-path walk.
    lengths = {n: len("/".join(_components(n, ".n"))) for n in ODD_NAMES}
    assert max(lengths.values()) > 1024  # macOS's PATH_MAX
    assert len(_components("/".join(["z"] * 500), ".n")) == 500
    assert all(len(c) <= 203 for n in ODD_NAMES for c in _components(n, ".n"))


def test_no_path_handed_to_the_os_is_longer_than_macos_takes(tmp_path, monkeypatch):
    longest = [0]

    def watching(call):
        def watched(path, *args, **kwargs):
            if isinstance(path, (str, bytes)):
                longest[0] = max(longest[0], len(os.fsencode(path)))
            return call(path, *args, **kwargs)
        return watched

    for call in ("open", "mkdir", "rename", "link", "scandir", "stat", "unlink"):
        monkeypatch.setattr(os, call, watching(getattr(os, call)))
    store = Store(tmp_path / "s")
    digest = store.put(b"x")
    deep = "/".join(["d"] * 300)
    wide = "/".join(c * 190 for c in "pqr")  # reached without a descriptor, then deeper
    names = ODD_NAMES + [deep + "/leaf", wide + "/" + "s" * 190 + "/" + "t" * 190 + "/u",
                         "𝄞" * 240 + "/x/y", "𝄞" * 240 + "/x/z/w"]
    for name in names:
        store.bind(name, digest)
    assert store.claim("𝄞" * 249, digest) and not store.claim("𝄞" * 249, digest)
    assert all(store.resolve(name).digest == digest for name in names)
    assert len(store.bound()) == len(names) + 1
    assert [b.name for b in store.bound("𝄞" * 240 + "/x")] == names[-2:]
    assert [b.name for b in store.bound(deep)] == [deep + "/leaf"]
    assert [b.name for b in store.bound(wide)] == [names[-3]]
    assert store.bound("𝄞" * 240 + "/nothing") == []
    assert 0 < longest[0] <= 1000


def test_walking_long_names_leaves_no_descriptor_open(tmp_path):
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc to count open descriptors")
    store = Store(tmp_path / "s", durable=False)
    digest = store.put(b"x")
    for name in ODD_NAMES:
        store.bind(name, digest)
    before = len(list(fds.iterdir()))
    for _ in range(3):
        store.bound()
        store.bound("𝄞" * 250)
        [store.resolve(name) for name in ODD_NAMES]
        store.claim("𝄞" * 250, digest)
    assert len(list(fds.iterdir())) == before


# -- processes


def test_32_processes_claiming_one_name_make_one_winner(tmp_path):
    store = Store(tmp_path / "s")
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    code = """
        import os, sys, time
        from somatize.store import Store
        where, me, ready, go = sys.argv[1:]
        store = Store(where)
        digest = store.put(("contender " + me).encode())
        open(os.path.join(ready, me), "w").close()
        while not os.path.exists(go):
            time.sleep(0.001)
        won = store.claim("round/7", digest, {"by": int(me)})
        print(digest, won)
    """
    children = [python(code, store.where, str(me), str(ready), str(go),
                       stdout=subprocess.PIPE, text=True) for me in range(32)]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(ready)) < 32:
            assert time.monotonic() < deadline, "the contenders did not all start"
            assert all(c.poll() in (None, 0) for c in children)
            time.sleep(0.01)
        go.touch()
        answers = [child.communicate(timeout=60)[0].split() for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert all(child.returncode == 0 for child in children)
    winners = [(me, digest) for me, (digest, won) in enumerate(answers) if won == "True"]
    assert len(winners) == 1, answers
    assert sum(won == "False" for _, won in answers) == 31
    (me, digest), = winners
    bound = store.resolve("round/7")
    assert (bound.digest, bound.meta) == (digest, {"by": me})
    assert store.get(digest) == f"contender {me}".encode()


def test_a_put_killed_half_way_leaves_no_object(tmp_path):
    store = Store(tmp_path / "s")
    size = 200_000_000
    code = """
        import sys
        from somatize.store import Store
        data = b"killed while writing" + bytes(int(sys.argv[2]))
        Store(sys.argv[1]).put(data)
        print("finished")
    """
    data = b"killed while writing" + bytes(size)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    child = python(code, store.where, str(size), stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60

    def writing() -> bool:  # any file in the store with bytes in it, wherever it is
        for path in Path(store.where).rglob("*"):
            try:
                if path.is_file() and path.stat().st_size > 0:
                    return True
            except FileNotFoundError:  # a probe or temp file gone between listing and stat
                pass
        return False

    try:
        while not writing():
            assert child.poll() is None, "the writer ended before it was seen writing"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        out, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL and out == b""
    assert store.get(digest) is None
    assert list(Path(store.where, "objects").rglob(digest[7:])) == []
    assert store.bound() == []
    assert store.put(data) == digest
    assert store.get(digest) == data


def test_a_store_handed_to_another_process_opens_the_same_place(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    store.keep("from/parent", [1, 2])
    child = python("""
        import pickle, sys
        store = pickle.load(sys.stdin.buffer)
        print(repr(store))
        store.keep("from/child", store.recall("from/parent") + [3])
    """, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
    out, _ = child.communicate(pickle.dumps(store), timeout=60)
    assert child.returncode == 0
    assert out.decode().strip() == repr(store)
    assert "durable=False" in repr(store)
    assert store.recall("from/child") == [1, 2, 3]


def test_readers_never_see_a_record_half_written(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    digests = [store.put(bytes([i])) for i in range(2)]
    store.bind("busy", digests[0], {"pad": "x" * 100_000})
    writer = python("""
        import sys
        from somatize.store import Store
        store = Store(sys.argv[1], durable=False)
        digests = sys.argv[2:]
        for i in range(300):
            store.bind("busy", digests[i % 2], {"pad": "x" * 100_000, "i": i})
    """, store.where, *digests)
    seen = 0
    while writer.poll() is None:
        bound = store.resolve("busy")
        assert bound.digest in digests and len(bound.meta["pad"]) == 100_000
        seen += 1
    assert writer.returncode == 0 and seen > 0
    assert store.resolve("busy").meta["i"] == 299


# -- opening


@pytest.mark.parametrize("setup, target, reason", [
    (lambda t: (t / "file").write_text("x"), "file/s", "Not a directory"),
    (lambda t: (t / "file").write_text("x"), "file", "not a directory"),
    (lambda t: (t / "s").mkdir() or (t / "s" / "objects").write_text("x"), "s", "exists"),
    (lambda t: (t / "s").mkdir() or (t / "s" / "tmp").write_text("x"), "s", "exists"),
    (lambda t: None, "x" * 300, "too long"),
], ids=["parent-is-a-file", "is-a-file", "objects-is-a-file", "tmp-is-a-file", "name-too-long"])
def test_a_place_that_cannot_be_written_is_refused_at_once(tmp_path, setup, target, reason):
    setup(tmp_path)
    where = tmp_path / target
    with pytest.raises(StoreError) as caught:
        Store(where)
    message = str(caught.value)
    assert str(where) in message and reason.lower() in message.lower()


def test_a_directory_is_a_path(tmp_path):
    with pytest.raises(TypeError, match="int"):
        Store(3)
    assert Store(str(tmp_path / "a")).where == str(tmp_path / "a")
    assert Store(os.fsencode(tmp_path / "b")).where == str(tmp_path / "b")


def test_a_relative_directory_stays_where_it_was_opened(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = Store("rel/s")
    assert store.where == str(tmp_path / "rel" / "s")
    monkeypatch.chdir("/")
    store.keep("x", 1)
    assert Store(tmp_path / "rel" / "s").recall("x") == 1


def test_not_durable_and_durable_stores_share_one_directory(tmp_path):
    fast = Store(tmp_path / "s", durable=False)
    slow = Store(tmp_path / "s")
    assert repr(fast) == f"Store({str(tmp_path / 's')!r}, durable=False)"
    assert repr(slow) == f"Store({str(tmp_path / 's')!r})"
    fast.keep("a", {"x": 1})
    assert slow.recall("a") == {"x": 1}
    assert slow.claim("c", slow.put(b"1")) and not fast.claim("c", fast.put(b"2"))


# -- many names (how fast is benchmarks/store.py's business, not a test's)


def test_ten_thousand_names_list_whole_and_in_order(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    digest = store.put(b"x")
    for i in range(10_000):
        store.bind(f"many/{i // 100}/{i % 100}", digest, {"i": i})
    listed = store.bound()
    assert len(listed) == 10_000 and listed[0].name == "many/0/0"
    assert [b.meta["i"] for b in store.bound("many/42")] == sorted(
        range(4200, 4300), key=lambda i: str(i % 100))


# -- a store nobody may write


READER = """
    import json, sys, warnings
    from somatize import StoreError
    from somatize.cli import main
    from somatize.record import Recorder, runs
    from somatize.store import Store

    where = sys.argv[1]
    said = {}
    store = Store(where)
    said["recalled"] = store.recall("kept/value")
    said["names"] = [bound.name for bound in store.bound()]
    said["runs"] = [run.name for run in runs(store)]
    said["somatize runs"] = main(["runs", where])
    said["somatize show"] = main(["show", where, "r", "--forward", "0"])
    for attempt in (lambda: store.keep("new/name", 1), lambda: store.put(b"new bytes")):
        try:
            attempt()
        except StoreError as exc:
            said.setdefault("refused", []).append(str(exc))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        recorder = Recorder(store, run="later")
        for _ in range(3):
            recorder({"fact": "began"})
            recorder({"fact": "finished", "took_us": 1})
        recorder.close()
    said["lost"] = recorder.lost
    said["warned"] = [str(warning.message) for warning in warned]
    print(json.dumps(said))
"""


def snapshot(where: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(where)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in where.rglob("*")}


def test_a_store_nobody_may_write_can_be_read_and_refuses_writes_saying_so(tmp_path,
                                                                         unwritable):
    where = tmp_path / "archive"
    store = Store(where)
    store.keep("kept/value", {"a": [1, 2]})
    recorder = Recorder(store, run="r")
    recorder({"fact": "began"})
    recorder({"fact": "finished", "took_us": 7})
    recorder.close()
    before = snapshot(where)
    with unwritable(where) as (seen, how):
        assert not os.access(seen / "tmp", os.W_OK) or os.geteuid() == 0
        child = python(READER, str(seen), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, **how)
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "Traceback" not in err
    lines = out.strip().splitlines()
    said = json.loads(lines[-1])
    assert said["recalled"] == {"a": [1, 2]}
    assert said["names"] == ["kept/value", "run/r/0"] and said["runs"] == ["r"]
    assert said["somatize runs"] == 0 and said["somatize show"] == 0
    assert any(line.startswith("r ") for line in lines) and "finished" in out
    assert len(said["refused"]) == 2
    for refusal in said["refused"]:
        assert "read-only" in refusal and str(seen) in refusal and "copy" in refusal
    assert said["lost"] == 3  # the Recorder went on, and says what it lost
    assert len(said["warned"]) == 1 and "read-only" in said["warned"][0]
    assert snapshot(where) == before  # opening, reading and refusing wrote nothing


def test_a_store_that_lacks_tmp_and_may_not_make_it_still_opens(tmp_path, unwritable):
    where = tmp_path / "archive"
    Store(where).keep("kept/value", [3])
    (where / "tmp").rmdir()
    with unwritable(where) as (seen, how):
        child = python("""
            import sys
            from somatize import StoreError
            from somatize.store import Store
            store = Store(sys.argv[1])
            print(store.recall("kept/value"))
            try:
                store.keep("x", 1)
            except StoreError as exc:
                print("refused:", exc)
        """, str(seen), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **how)
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.splitlines()[0] == "[3]" and "read-only" in out.splitlines()[1]
    assert not (where / "tmp").exists()


# -- what crashed writers leave behind


PUTTER = """
    import sys
    from somatize.store import Store
    data = b"killed while writing" + bytes(int(sys.argv[2]))
    Store(sys.argv[1]).put(data)
    print("finished")
"""


def temp_files(store: Store) -> list[Path]:
    return [p for p in Path(store.where, "tmp").iterdir() if p.is_file()]


def caught_writing(store: Store, child: subprocess.Popen) -> Path:
    """The temp file ``child`` is writing, as soon as it has bytes in it."""
    deadline = time.monotonic() + 60
    while True:
        for path in temp_files(store):
            try:
                if path.stat().st_size > 0:
                    return path
            except FileNotFoundError:
                pass
        assert child.poll() is None, "the writer ended before it was seen writing"
        assert time.monotonic() < deadline, "the writer never started writing"
        time.sleep(0.001)


def aged(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_writers_temp_file_is_removed_once_it_is_old(tmp_path):
    store = Store(tmp_path / "s")
    child = python(PUTTER, store.where, str(200_000_000), stdout=subprocess.PIPE)
    try:
        left = caught_writing(store, child)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert temp_files(store) == [left] and left.stat().st_size > 0
    Store(store.where)  # less than an hour old: perhaps somebody's, so it stays
    assert temp_files(store) == [left]
    aged(left, 3599)
    Store(store.where)
    assert temp_files(store) == [left]
    aged(left, 3601)
    Store(store.where)
    assert temp_files(store) == []
    assert store.bound() == [] and list(Path(store.where, "objects").rglob("*")) == []


def test_a_live_writer_keeps_its_temp_file_however_old_it_looks(tmp_path):
    store = Store(tmp_path / "s")
    size = 200_000_000
    child = python(PUTTER, store.where, str(size), stdout=subprocess.PIPE)
    try:
        writing = caught_writing(store, child)
        child.send_signal(signal.SIGSTOP)  # stalled in the middle of its put
        aged(writing, 2 * 3600)
        Store(store.where)
        assert writing.exists()  # a process of this machine, alive: its file is its own
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=120)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0 and out == b"finished\n"
    data = b"killed while writing" + bytes(size)
    assert store.get("sha256:" + hashlib.sha256(data).hexdigest()) == data
    assert temp_files(store) == []


def test_another_machines_temp_files_go_by_age_alone(tmp_path):
    store = Store(tmp_path / "s")
    tmp = Path(store.where, "tmp")
    old, fresh = tmp / f"elsewhere-{os.getpid()}-0a0b", tmp / "elsewhere-1-0c0d"
    stray = tmp / "no-pid-at-all"
    for path in (old, fresh, stray):
        path.write_bytes(b"half a record")
    aged(old, 3601)
    aged(stray, 3601)
    (tmp / "a-directory").mkdir()  # not a writer's file: left alone
    aged(tmp / "a-directory", 3601)
    Store(store.where)
    assert sorted(p.name for p in tmp.iterdir()) == ["a-directory", fresh.name]


def test_how_old_is_stale_can_be_said(tmp_path):
    where = tmp_path / "s"
    Store(where)
    left = where / "tmp" / "elsewhere-1-0e0f"
    left.write_bytes(b"x")
    aged(left, 120)
    Store(where)
    assert left.exists()
    backend = DirectoryBackend(where, stale_after=60)
    assert not left.exists()
    again = pickle.loads(pickle.dumps(Store.over(backend)))
    assert again.backend.stale_after == 60 and STALE_AFTER == 3600
    with pytest.raises(ValueError, match="stale_after=0"):
        DirectoryBackend(where, stale_after=0)


# -- one bad record, and links planted in the store


def record_file(store: Store, name: str) -> Path:
    return Path(store.where, "names", *_components(name, ".n"))


def test_one_unreadable_record_does_not_hide_the_others(tmp_path, reading):
    store = Store(tmp_path / "s")
    digest = store.put(b"x")
    for name in ("run/a/0", "run/a/1", "run/a/2", "run/b/0", "other"):
        store.bind(name, digest, {"name": name})
    record_file(store, "run/a/1").write_bytes(b'{"digest": ')  # garbled
    fifo = record_file(store, "run/b/0")
    fifo.unlink()
    os.mkfifo(fifo)  # not a plain file: reading it would wait forever
    with pytest.warns(UserWarning) as warned:
        listed = store.bound()
    assert [b.name for b in listed] == ["other", "run/a/0", "run/a/2"]
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "2 name records" in message and "'run/a/1'" in message and "'run/b/0'" in message
    assert "not a plain file" in message and "Bind each such name again" in message
    with pytest.warns(UserWarning, match="'run/a/1'"):
        assert [b.name for b in store.bound("run/a")] == ["run/a/0", "run/a/2"]
    with pytest.warns(UserWarning, match="'run/a/1'"):
        from somatize.record import runs
        assert [(r.name, r.forwards) for r in runs(store)] == [("a", 2)]
    with pytest.raises(StoreError, match="not a plain file"):
        store.resolve("run/b/0")
    store.bind("run/a/1", digest)  # mending it: listed again, and no warning
    fifo.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(store.bound()) == 4


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file, whatever its mode")
def test_a_record_this_process_may_not_read_is_left_out_with_a_warning(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.put(b"x")
    store.bind("a", digest)
    store.bind("b", digest)
    record_file(store, "a").chmod(0)
    with pytest.warns(UserWarning, match="'a' \\(Permission denied\\)"):
        assert [b.name for b in store.bound()] == ["b"]


def test_links_planted_under_names_are_never_followed(tmp_path, reading):
    store = Store(tmp_path / "s")
    assert (store.backend._open is None) == (reading == "walk")
    digest = store.put(b"x")
    store.bind("real", digest)
    record = record_file(store, "real").read_bytes()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.n").write_bytes(record)  # a record, so following it would "work"
    (outside / "0.n").write_bytes(record)
    before = snapshot(outside)
    names = Path(store.where, "names")
    (names / "planted.n").symlink_to(outside / "secret.n")
    (names / "run.d").mkdir()
    (names / "run.d" / "x.d").symlink_to(outside)
    (names / "linked.d").symlink_to(outside)
    with pytest.warns(UserWarning) as warned:
        assert [b.name for b in store.bound()] == ["real"]
    message = str(warned[0].message)
    assert len(warned) == 1 and "3 name records" in message
    assert "names/planted.n" in message and "names/run.d/x.d" in message
    assert "symbolic link" in message
    for name in ("planted", "run/x/0", "linked/secret"):
        with pytest.raises(StoreError, match="symbolic link.*remove it"):
            store.resolve(name)
    with pytest.warns(UserWarning, match="names/linked.d"):
        assert store.bound("linked") == []
    for write in (lambda: store.bind("run/x/1", digest), lambda: store.claim("linked/y", digest),
                  lambda: store.claim("planted", digest)):
        with pytest.raises(StoreError, match="symbolic link"):
            write()
    assert snapshot(outside) == before  # nothing was read through, nor written, out there
    store.bind("planted", digest)  # binding replaces the link itself, not what it leads to
    assert not (names / "planted.n").is_symlink() and store.resolve("planted").digest == digest
    assert snapshot(outside) == before


def test_links_planted_under_objects_are_never_followed(tmp_path, reading):
    store = Store(tmp_path / "s")
    assert (store.backend._open is None) == (reading == "walk")
    data, other = b"precious", b"other bytes"
    digest, elsewhere = [("sha256:" + hashlib.sha256(d).hexdigest()) for d in (data, other)]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / digest[7:]).write_bytes(data)
    (outside / elsewhere[7:]).write_bytes(other)
    before = snapshot(outside)
    objects = Path(store.where, "objects")
    (objects / digest[7:9]).mkdir()
    (objects / digest[7:9] / digest[7:]).symlink_to(outside / digest[7:])
    fanned = objects / elsewhere[7:9]
    if fanned.exists():
        pytest.skip("both digests share a fan-out directory")
    fanned.symlink_to(outside)
    assert store.get(digest) is None  # a link is not the object, even to the right bytes
    with pytest.raises(StoreError, match="not have that object"):
        store.bind("n", digest)
    assert store.put(data) == digest  # heals: the link is replaced by the object itself
    assert not object_file(store, digest).is_symlink() and store.get(digest) == data
    for attempt in (lambda: store.get(elsewhere), lambda: store.put(other),
                    lambda: store.bind("m", elsewhere)):
        with pytest.raises(StoreError, match=f"objects/{elsewhere[7:9]} .*symbolic link"):
            attempt()
    assert snapshot(outside) == before


def test_a_link_above_the_store_is_the_users_own_and_followed(tmp_path, reading):
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    store = Store(tmp_path / "via" / "s")
    assert store.where == str(tmp_path / "via" / "s")
    digest = store.keep("run/a/0", [1, 2])
    assert store.recall("run/a/0") == [1, 2] and store.get(digest) is not None
    assert [b.name for b in Store(tmp_path / "real" / "s").bound()] == ["run/a/0"]


# -- bad bytes


def test_put_heals_an_object_whose_bytes_on_disk_are_corrupt(tmp_path, reading):
    store = Store(tmp_path / "s")
    spoils = [lambda raw: raw[:3], lambda raw: bytes([raw[0] ^ 1]) + raw[1:],
              lambda raw: raw[:-1] + bytes([raw[-1] ^ 1])]  # in the last of several pieces
    for spoil, size in zip(spoils, (1000, 1000, 3 * local._PIECE + 5)):
        data = os.urandom(size)
        digest = store.put(data)
        path = object_file(store, digest)
        path.chmod(0o644)
        path.write_bytes(spoil(path.read_bytes()))
        with pytest.raises(CorruptObject, match=digest):
            store.get(digest)
        assert store.put(data) == digest
        assert store.get(digest) == data
        assert store.put(bytearray(data)) == digest  # compared, not hashed: still healed
        assert store.put(memoryview(b"!" + data)[1:]) == digest


def test_put_of_a_good_object_does_not_rewrite_it(tmp_path):
    store = Store(tmp_path / "s")
    digest = store.put(b"good " * 100)
    before = os.stat(object_file(store, digest))
    for again in (b"good " * 100, memoryview(b"xgood " * 100)[1:]):  # the second is no copy
        if isinstance(again, memoryview):
            again = memoryview(bytes(again))
        store.put(again)
    after = os.stat(object_file(store, digest))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


RECORDS = st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                 lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.sampled_from(["digest", "meta", "when", "x"]), inner,
                                   max_size=4), max_leaves=12).map(
        lambda doc: json.dumps(doc).encode()),
    st.fixed_dictionaries({
        "digest": st.sampled_from([DIGEST_OF_X, DIGEST_OF_X[:-1], 7, None]),
        "meta": st.one_of(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                          st.lists(st.integers(), max_size=2), st.none()),
        "when": st.one_of(st.floats(), st.integers(min_value=-2**1100, max_value=2**1100),
                          st.text(max_size=3)),
    }).map(lambda doc: json.dumps(doc).encode()),
    st.integers(min_value=1, max_value=5000).map(lambda depth: b"[" * depth + b"]" * depth),
)


@pytest.mark.slow
def test_a_name_record_is_a_bound_or_corrupt_whatever_its_bytes(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    assert store.put(b"x") == DIGEST_OF_X
    store.bind("fine", DIGEST_OF_X)
    path = record_file(store, "fuzzed")
    tried, corrupt = [0], [0]

    @settings(max_examples=1000, deadline=None, database=None)
    @given(RECORDS)
    def check(record):
        tried[0] += 1
        path.unlink(missing_ok=True)  # not a rewrite in place: ext4 flushes on truncation
        path.write_bytes(record)
        try:
            bound = store.resolve("fuzzed")
        except CorruptObject as exc:
            corrupt[0] += 1
            assert "'fuzzed'" in str(exc) and "bind the name again" in str(exc)
            with pytest.warns(UserWarning, match="'fuzzed'"):
                assert [b.name for b in store.bound()] == ["fine"]
        else:
            assert bound.name == "fuzzed" and math.isfinite(bound.when)
            assert len(store.bound()) == 2

    check()
    print(f"name records: {tried[0]} tried, {corrupt[0]} corrupt, 0 other errors")
    assert tried[0] >= 900 and 0 < corrupt[0] < tried[0]
