"""What remembering costs, side by side with its anchors.

1. Key hashing of a 256 MB input vs hashlib.sha256 over the same bytes (target ≥ 0.9x
   its throughput: the encoding is fed to the hash where the bytes lie).
2. A cache hit of a small value vs joblib.Memory on the same function and input, with
   a Store and with ``store="path"`` (target: at most 0.5x joblib's time), and the key
   of a list of 100 ints vs ``joblib.hash`` of it.
3. ``.mapped()`` over 10,000 items with one new item vs all items missing (target:
   under 5% of the all-miss time). Each item costs ~0.2 ms to compute, about what a
   small embedding model spends per short document on a CPU.
4. ``foreseen_json`` on a 1,000-node chain (target: under 50 ms).
5. ``put`` of 1 KiB never kept, vs writing the same bytes to a temp file and renaming
   it into place (what any atomic write costs; target: under 2x), and of 64 MiB kept
   already, vs hashing them (put hashes, then compares with what is kept, so that a
   corrupt object is healed; target: under 2x).

    python benchmarks/store.py
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

from somatize import Graph, Node
from somatize._keys import digest_of
from somatize.store import Store

from _bench import best


def hashing() -> None:
    data = os.urandom(256 * 2**20)
    ours = best(lambda: digest_of(data), 5)
    plain = best(lambda: hashlib.sha256(data).digest(), 5)
    print(f"1. key of 256 MB: {256 / ours:7.0f} MB/s   hashlib.sha256 {256 / plain:7.0f} MB/s"
          f"   ratio {plain / ours:.3f}x of hashlib's throughput (target >= 0.9)")


def square(x):
    return {"squares": [v * v for v in x["values"]], "name": x["name"]}


class Square(Node):
    def forward(self, x, ctx):
        return square(x)


def cache_hit(where: str) -> None:
    import joblib

    value = {"values": list(range(64)), "name": "a small input"}
    g = Graph.somatize(Square().cached())
    path = os.path.join(where, "soma")
    store = Store(path)
    g.forward(value, store=store)
    memory = joblib.Memory(os.path.join(where, "joblib"), verbose=0)
    cached_square = memory.cache(square)
    cached_square(value)
    given = best(lambda: g.forward(value, store=store), 300, 0.1)
    named = best(lambda: g.forward(value, store=path), 300, 0.1)
    theirs = best(lambda: cached_square(value), 300, 0.1)
    assert g.forward(value, store=path) == cached_square(value)
    print(f"2. cache hit: store=Store {given * 1e6:4.0f} µs   store=\"path\" {named * 1e6:4.0f} µs"
          f"   joblib.Memory {theirs * 1e6:4.0f} µs   path/joblib {named / theirs:.2f}x"
          " (target <= 0.5)")
    ints = list(range(100))
    key = best(lambda: digest_of(ints), 300, 0.1)
    hashed = best(lambda: joblib.hash(ints), 300, 0.1)
    print(f"   key of a list of 100 ints {key * 1e6:5.1f} µs   joblib.hash {hashed * 1e6:5.1f} µs"
          f"   ratio {key / hashed:.2f}x")


class Embed(Node):
    def forward(self, items, ctx):
        out = []
        for item in items:
            until = time.perf_counter() + 0.0002
            while time.perf_counter() < until:
                pass
            out.append(len(item))
        return out


def mapped(where: str) -> None:
    items = [f"document number {i}" for i in range(10_000)]
    g = Graph.somatize(Embed().mapped().cached())
    store = Store(os.path.join(where, "mapped"), durable=False)
    start = time.perf_counter()
    g.forward(items, store=store)
    all_miss = time.perf_counter() - start
    start = time.perf_counter()
    g.forward(items[:-1] + ["a new document"], store=store)
    one_new = time.perf_counter() - start
    print(f"3. mapped over 10,000: all missing {all_miss:6.2f} s   one new {one_new:6.3f} s"
          f"   {one_new / all_miss * 100:.1f}% of all-miss (target < 5%)")


class Step(Node):
    def forward(self, x, ctx):
        return x


def foreseen(where: str) -> None:
    piece = Step().cached()
    for _ in range(999):
        piece = piece >> Step().cached()
    g = Graph.somatize(piece)
    store = Store(os.path.join(where, "foreseen"))
    g.foreseen_json(1, store=store)  # compile once, as any second call would find it
    took = best(lambda: g.foreseen_json(1, store=store), 5)
    print(f"4. foreseen_json on a 1,000-node chain: {took * 1e3:.1f} ms (target < 50 ms)")


def putting(where: str) -> None:
    store = Store(os.path.join(where, "put"), durable=False)
    fresh = iter([os.urandom(1024) for _ in range(3000)])
    ours = best(lambda: store.put(next(fresh)), 1000)
    plain_dir = os.path.join(where, "plain")
    os.mkdir(plain_dir)
    count = iter(range(3000))

    def plain() -> None:
        data = os.urandom(1024)
        temp, final = f"{plain_dir}/t", f"{plain_dir}/{next(count)}"
        with open(temp, "wb") as handle:
            handle.write(data)
        os.replace(temp, final)

    theirs = best(plain, 1000)
    big = os.urandom(64 << 20)
    store.put(big)
    again = best(lambda: store.put(big), 5)
    hashed = best(lambda: hashlib.sha256(big).digest(), 5)
    print(f"5. put 1 KiB new: {ours * 1e6:5.0f} µs   temp file + rename {theirs * 1e6:5.0f} µs"
          f"   ratio {ours / theirs:.2f}x (target < 2);  put 64 MiB kept already:"
          f" {again * 1e3:4.0f} ms   sha256 {hashed * 1e3:4.0f} ms   ratio {again / hashed:.2f}x"
          " (target < 2)")


def listing(where: str) -> None:
    store = Store(os.path.join(where, "listed"), durable=False)
    digest = store.put(b"x")
    for i in range(10_000):
        store.bind(f"many/{i // 100}/{i % 100}", digest, {"i": i})
    took = best(store.bound, 5)
    names = os.path.join(where, "listed", "names")
    walked = best(lambda: [f for _, _, files in os.walk(names) for f in files], 5)
    print(f"6. bound() over 10,000 names: {took * 1e3:.0f} ms (target < 500 ms); "
          f"os.walk of the same folder alone {walked * 1e3:.0f} ms")


def main() -> None:
    where = tempfile.mkdtemp()
    try:
        hashing()
        cache_hit(where)
        mapped(where)
        foreseen(where)
        putting(where)
        listing(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
