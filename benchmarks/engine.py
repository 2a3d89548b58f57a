"""Per-node overhead of the walk, side by side with the physical limit and with dask.

Shapes: a chain of 500 trivial nodes, and a fan-in of 500 into one. The plain loop
calls the same ``forward``s directly (nothing can be cheaper); dask runs the same
shapes through ``dask.core.get`` and ``dask.local.get_sync``. Also: the same walk with
a watcher collecting every fact, and planning a 10,000-node graph.

    python benchmarks/engine.py
"""

from __future__ import annotations

import time

from somatize import Ctx, Graph, Node

from _bench import best

N = 500
REPEAT = 200


class Step(Node):
    def forward(self, x, ctx):
        return x


class Join(Node):
    def forward(self, x, ctx):
        return len(x)


def chain():
    nodes = [Step() for _ in range(N)]
    piece = nodes[0]
    for n in nodes[1:]:
        piece = piece >> n
    g = Graph.somatize(piece)
    ctx = Ctx()

    def plain():
        x = 1
        for n in nodes:
            x = n.forward(x, ctx)
        return x

    dsk = {f"n{i}": (nodes[i].forward, f"n{i - 1}" if i else 1, ctx) for i in range(N)}
    return g, plain, dsk, f"n{N - 1}"


def fan_in():
    sources = [Step() for _ in range(N)]
    join = Join()
    piece = sources[0]
    for s in sources[1:]:
        piece = piece | s
    g = Graph.somatize(piece >> join)
    ctx = Ctx()
    ids = [f"step_{i + 1}" if i else "step" for i in range(N)]

    def plain():
        gathered = {i: s.forward(1, ctx) for i, s in zip(ids, sources)}
        return join.forward(gathered, ctx)

    def collect(*values):
        return join.forward(dict(zip(ids, values)), ctx)

    dsk = {f"s{i}": (sources[i].forward, 1, ctx) for i in range(N)}
    dsk["join"] = (collect, *[f"s{i}" for i in range(N)])
    return g, plain, dsk, "join"


def main() -> None:
    try:
        import dask.core
        import dask.local
    except ImportError:
        dask = None
    print(f"per-node cost, {N} nodes, best decile of {REPEAT} runs (µs/node)")
    print(f"{'shape':8} {'plain':>7} {'walk':>7} {'watched':>8} {'dask.core':>10} {'get_sync':>9}"
          f" {'walk/plain':>11} {'watched/walk':>13} {'dask.core/walk':>15}")
    for name, make in (("chain", chain), ("fan-in", fan_in)):
        g, plain, dsk, out = make()
        assert g.forward(1) == plain()
        facts = []
        t_plain = best(plain, REPEAT, 0.1) / N * 1e6
        t_walk = best(lambda: g.forward(1), REPEAT, 0.1) / N * 1e6

        def watched():
            facts.clear()
            g.forward(1, watching=facts.append)

        t_watch = best(watched, REPEAT, 0.1) / N * 1e6
        t_dask = best(lambda: dask.core.get(dsk, out), 50, 0.1) / N * 1e6
        t_sync = best(lambda: dask.local.get_sync(dsk, out), 20, 0.1) / N * 1e6
        print(f"{name:8} {t_plain:7.3f} {t_walk:7.3f} {t_watch:8.3f} {t_dask:10.3f} {t_sync:9.3f}"
              f" {t_walk / t_plain:10.2f}x {t_watch / t_walk:12.2f}x {t_dask / t_walk:14.1f}x")

    g = Graph()
    previous = g.node("n0", Step())
    for i in range(1, 10_000):
        current = g.node(f"n{i}", Step())
        g.edge(previous, current)
        if i % 7 == 0 and i > 10:
            g.edge(f"n{i - 9}", current)
        previous = current
    start = time.perf_counter()
    plan = g.plan()
    took = time.perf_counter() - start
    start = time.perf_counter()
    g.plan_json()
    took_json = time.perf_counter() - start
    print(f"planning 10,000 nodes: plan() {took * 1e3:.1f} ms, plan_json() {took_json * 1e3:.1f} ms"
          f" (target < 100 ms), {len(plan.steps)} steps")


if __name__ == "__main__":
    main()
