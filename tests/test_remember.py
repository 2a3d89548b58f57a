"""Remembered by content: the seed's cache walkthrough without torch, and the rules."""

import json

import pytest

from somatize import CacheError, Graph, Node, NodeError, Opaque, UnwritableError, codec
from somatize.store import Store


class Vec:
    """A stand-in for a tensor: something that is not data and has a codec."""

    def __init__(self, *values):
        self.values = list(values)

    def __eq__(self, other):
        return isinstance(other, Vec) and self.values == other.values


codec("test.remember.Vec", Vec, dump=lambda v: json.dumps(v.values).encode(),
      load=lambda raw: Vec(*json.loads(raw)))


class Body(Node):
    def __init__(self, scale=2):
        self.scale = scale

    def parameters(self):
        return [self.scale]

    def forward(self, x, ctx):
        return Opaque(Vec(*[v * self.scale for v in x.values]))


class Head(Node):
    def forward(self, x, ctx):
        return sum(x.values)


def said(facts):
    return [(f["fact"], f.get("node")) for f in facts if f["fact"] not in ("began", "finished")]


def test_the_cache_walkthrough(tmp_path):
    g = Graph.somatize(Body().named("body").frozen().cached() >> Head().named("head"))
    batch = Opaque(Vec(1, 2, 3))
    first, again, other = [], [], []
    assert g.forward(batch, store=tmp_path, watching=first.append) == 12
    assert said(first) == [("ran", "body"), ("kept", "body"), ("ran", "head")]
    assert g.forward(Opaque(Vec(1, 2, 3)), store=tmp_path, watching=again.append) == 12
    assert said(again) == [("recalled", "body"), ("ran", "head")]
    assert first[2]["key"] == again[1]["key"] and first[2]["key"].startswith("key/")
    assert g.forward(Opaque(Vec(4)), store=str(tmp_path), watching=other.append) == 8
    assert said(other) == [("ran", "body"), ("kept", "body"), ("ran", "head")]


class Step(Node):
    def __init__(self, n):
        self.n = n

    def forward(self, x, ctx):
        return x + self.n


def chain():
    return Graph.somatize(Step(1).named("a").cached() >> Step(2).named("b").cached()
                          >> Step(3).named("c"))


def test_what_is_under_a_recalled_node_is_unneeded(tmp_path):
    g = chain()
    g.forward(0, store=tmp_path)
    seen = []
    assert g.forward(0, store=tmp_path, watching=seen.append) == 6
    assert said(seen) == [("unneeded", "a"), ("recalled", "b"), ("ran", "c")]


def test_foreseen_names_every_output_with_nothing_run(tmp_path):
    g = chain()
    assert json.loads(g.foreseen_json(0)) == {"keys": {}, "unneeded": []}
    before = json.loads(g.foreseen_json(0, store=tmp_path))
    assert list(before["keys"]) == ["a", "b", "c"] and before["unneeded"] == []
    seen = []
    g.forward(0, store=tmp_path, watching=seen.append)
    kept = {f["node"]: f["key"] for f in seen if f["fact"] == "kept"}
    assert kept == {"a": before["keys"]["a"], "b": before["keys"]["b"]}
    after = json.loads(g.foreseen_json(0, store=tmp_path))
    assert after == {"keys": before["keys"], "unneeded": ["a"]}
    assert json.loads(g.foreseen_json(1, store=tmp_path))["keys"]["a"] != before["keys"]["a"]


def test_foreseen_leaves_out_what_cannot_be_told(tmp_path):
    class Each(Node):
        def forward(self, xs, ctx):
            return xs

    g = Graph.somatize(Step(1).named("a") >> Each().named("m").mapped() >> Step(1).named("z"))
    assert list(json.loads(g.foreseen_json(5, store=tmp_path))["keys"]) == ["a"]
    assert json.loads(g.foreseen_json(Opaque(object()), store=tmp_path))["keys"] == {}


def test_keys_follow_salt_state_and_declaration_not_device_or_fingerprint(tmp_path):
    def key(piece, fingerprint=None):
        g = Graph.somatize(piece)
        if fingerprint:
            g.written_as(g.nodes()[0], fingerprint)
        return json.loads(g.foreseen_json(1, store=tmp_path))["keys"][g.nodes()[0]]

    base = key(Step(1).named("s"))
    assert key(Step(1).named("s").on("cuda:0")) == base
    assert key(Step(1).named("s"), fingerprint="v9") == base
    assert key(Step(1).named("s").at("w1")) == base
    assert key(Step(2).named("s")) != base
    assert key(Step(1).named("s").cached("other run")) != base
    g = Graph.somatize(Step(1).named("s"))
    g.freeze("s", "sha256:" + "1" * 64)
    assert json.loads(g.foreseen_json(1, store=tmp_path))["keys"]["s"] != base


def test_a_cache_over_something_that_can_change_is_refused_before_anything_runs(tmp_path):
    ran = []

    class Watch(Node):
        def forward(self, x, ctx):
            ran.append(x)
            return Opaque(x)

    g = Graph.somatize(Watch() >> Body().named("body") >> Head().named("head").cached())
    with pytest.raises(CacheError, match="'head' is .cached\\(\\) but 'body' is above it"):
        g.forward(Opaque(Vec(1)), store=tmp_path)
    g = Graph.somatize(Watch() >> Body().named("body").cached())
    with pytest.raises(CacheError, match="'body' is itself"):
        g.forward(Opaque(Vec(1)), store=tmp_path)
    assert ran == []
    # without a store nothing is kept, so nothing can lie
    assert g.forward(Opaque(Vec(1))) == Vec(2)


def test_a_cached_node_built_from_something_unwritable_is_refused(tmp_path):
    g = Graph.somatize(Step(object()).named("s").cached())
    with pytest.raises(CacheError, match="built with a object"):
        g.forward(1, store=tmp_path)
    g.declared_as("s", {"what": "a step of one"})
    with pytest.raises(NodeError, match="TypeError"):  # now it runs, and fails inside
        g.forward(1, store=tmp_path)


def test_an_unwritable_input_is_refused_only_when_a_cache_needs_it(tmp_path):
    class Thing:
        pass

    class Use(Node):
        def forward(self, x, ctx):
            return 1

    assert Graph.somatize(Use()).forward(Opaque(Thing()), store=tmp_path) == 1
    g = Graph.somatize(Use().cached())
    with pytest.raises(UnwritableError, match="input is a .*Thing, which cannot be written"):
        g.forward(Opaque(Thing()), store=tmp_path)


def test_a_different_fingerprint_on_a_hit_is_said(tmp_path, capfd):
    g = chain()
    g.written_as("b", "1.0")
    g.forward(0, store=tmp_path)
    g.written_as("b", "2.0")
    g.forward(0, store=tmp_path)
    err = capfd.readouterr().err
    assert "node 'b' recalled an output kept by version '1.0'; this graph says '2.0'" in err


def test_a_mapped_node_is_handed_only_the_missing_items(tmp_path):
    handed = []

    class Embed(Node):
        def forward(self, items, ctx):
            handed.append(list(items))
            return [Vec(len(item)) for item in items]

    g = Graph.somatize(Embed().named("embed").mapped().cached())
    docs = ["a", "bb", "ccc"]
    assert g.forward(docs, store=tmp_path) == [Vec(1), Vec(2), Vec(3)]
    seen = []
    assert g.forward(["bb", "dddd", "a"], store=tmp_path, watching=seen.append) == [
        Vec(2), Vec(4), Vec(1)]
    assert handed == [docs, ["dddd"]]
    assert ("recalled", "embed") in said(seen) and ("kept", "embed") in said(seen)
    assert g.forward(docs, store=tmp_path) and handed[-1] == ["dddd"]


def test_below_a_mapped_node_can_still_be_kept(tmp_path):
    class Each(Node):
        def forward(self, xs, ctx):
            return [x * 10 for x in xs]

    class Total(Node):
        def forward(self, xs, ctx):
            return sum(xs)

    g = Graph.somatize(Each().named("each").mapped().cached() >> Total().named("total").cached())
    assert g.forward([1, 2], store=tmp_path) == 30
    seen = []
    assert g.forward([1, 2], store=tmp_path, watching=seen.append) == 30
    assert said(seen) == [("recalled", "each"), ("recalled", "total")]


def test_a_cached_node_sent_elsewhere_is_refused(tmp_path):
    g = Graph.somatize(Step(1).at("w1").cached())
    with pytest.raises(CacheError, match="sent to host 'w1'"):
        g.forward(1, store=tmp_path, broker=object())


def test_a_store_is_opened_from_a_path_or_given(tmp_path):
    g = chain()
    store = Store(tmp_path / "s")
    g.forward(0, store=store)
    assert len(store.bound()) == 2
    with pytest.raises(TypeError, match="store= takes a Store or a directory"):
        g.forward(0, store=3)


def test_a_directory_is_opened_once_and_again_when_replaced(tmp_path):
    import shutil

    from somatize._remember import open_store

    g, where = chain(), tmp_path / "runs"
    assert g.forward(1, store=where) == g.forward(1, store=str(where)) == 7
    first = open_store(where)
    assert open_store(str(where)) is first and first.where == str(where)
    shutil.rmtree(where)  # gone: what was opened there is not what the path names now
    assert g.forward(1, store=where) == 7
    assert open_store(where) is not first and len(Store(where).bound()) == 2
