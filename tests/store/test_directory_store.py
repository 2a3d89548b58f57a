"""The directory store: the shared contract, then what only files on a disk can show."""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from contract import ODD_NAMES, StoreContract

import somatize
from somatize import CorruptObject, StoreError
from somatize.store import Store
from somatize.store.local import _components

SRC = str(Path(somatize.__file__).resolve().parent.parent)


class TestDirectoryStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return Store(tmp_path / "s")

    def reopen(self, store):
        return Store(store.where)


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
    with pytest.raises(StoreError, match="'run/x'.*bind the name again"):
        store.resolve("run/x")
    with pytest.raises(StoreError, match="'run/x'"):
        store.bound()


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


# -- speed


def test_ten_thousand_names_list_in_well_under_a_second(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    digest = store.put(b"x")
    for i in range(10_000):
        store.bind(f"many/{i // 100}/{i % 100}", digest, {"i": i})
    began = time.perf_counter()
    listed = store.bound()
    took = time.perf_counter() - began
    assert len(listed) == 10_000 and listed[0].name == "many/0/0"
    assert took < 0.5, f"bound() took {took:.3f}s"
    assert [b.meta["i"] for b in store.bound("many/42")] == sorted(
        range(4200, 4300), key=lambda i: str(i % 100))
