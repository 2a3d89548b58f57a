"""Runs recorded for the health tests: real forwards through a Recorder into a real
store, with ``health`` facts said after each one as an Audit says them."""

from somatize import Graph, Node
from somatize.record import Recorder


class Step(Node):
    def forward(self, x, ctx):
        return x + 1


def recorded(store, run, steps, *, summarising=None, every=1, loss=lambda n: 1.0 / n):
    """One forward per step, and its ``loss(step)``; after each measured one (every
    ``every``), a ``health`` fact per where: ``steps`` is a list of ``{where: {measure:
    value}}``, one per step (numbered from 1)."""
    g = Graph.somatize(Step().named("step"))
    recorder = Recorder(store, run=run, summarising=summarising)
    for number, wheres in enumerate(steps, 1):
        g.forward(number, watching=recorder)
        recorder({"fact": "loss", "value": loss(number)})
        if (number - 1) % every == 0:
            for where, measures in wheres.items():
                recorder({"fact": "health", "where": where, "step": number, **measures})
    recorder.close()
    return recorder


def chain(count, **per_where):
    """``count`` steps of the same measures: ``per_where`` maps where -> measures, or
    where -> a function of the step number answering them."""
    return [{where: (m(n) if callable(m) else dict(m)) for where, m in per_where.items()}
            for n in range(1, count + 1)]
