"""The first thing to run: build a graph, look at its plan, draw it in text, run it.

    .venv/bin/python examples/first.py    # from the clone, once make has set up .venv
"""

from somatize import Graph, Node


class Words(Node):
    def forward(self, text, ctx):
        return text.split()


class Count(Node):
    def forward(self, words, ctx):
        return len(words)


class Longest(Node):
    def forward(self, words, ctx):
        return max(words, key=len)


class Report(Node):
    def forward(self, parts, ctx):
        return f"{parts['count']} words, the longest is {parts['longest']!r}"


def main() -> None:
    g = Graph.somatize(Words() >> (Count() | Longest()) >> Report())
    print("nodes :", g.nodes())
    print("edges :", g.edges())
    print("plan  :", g.plan())
    print()
    print("drawn in text, one wave per line:")
    for step in g.plan().steps:
        print("   ", step)
    print()
    facts = []
    answer = g.forward("somatize runs a graph of plain objects", watching=facts.append)
    print("answer:", answer)
    print("facts :", [f["fact"] + (f" {f['node']}" if "node" in f else "") for f in facts])


if __name__ == "__main__":
    main()
