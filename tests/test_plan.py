import json

from hypothesis import given, settings
from hypothesis import strategies as st

from somatize import Graph, Node
from somatize._plan import Step as P, Remote, Seq, Wave, plan_from_json, plan_to_json, stages


class N(Node):
    def forward(self, x, ctx):
        return x


def test_a_stretch_on_one_host_is_one_round_trip():
    g = Graph.somatize(N() >> (N() >> N()).at("w1") >> N())
    assert g.plan() == Seq((P("n"), Remote("w1", Seq((P("n_2"), P("n_3")))), P("n_4")))


def test_remotes_of_one_wave_sit_side_by_side():
    g = Graph.somatize(N() >> (N().at("w1") | N().at("w2") | N() | N().at("w1")) >> N())
    assert repr(g.plan()) == (
        "Seq[n, Wave[n_4, Remote(w1: Wave[n_2, n_5]), Remote(w2: n_3)], n_6]")


def test_with_no_host_distribute_changes_nothing():
    g = Graph.somatize(N() >> (N() | N()) >> N())
    assert g.plan() == Seq((P("n"), Wave((P("n_2"), P("n_3"))), P("n_4")))


def test_json_round_trip():
    g = Graph.somatize(N() >> (N().at("w1") | N()) >> N().at("w1") >> N().at("w1"))
    data = json.loads(g.plan_json())
    assert plan_from_json(data) == g.plan()
    assert plan_from_json(g.plan_json()) == g.plan()
    assert data["Seq"][1] == {"Wave": [{"Node": "n_3"}, {"Remote": {"host": "w1", "plan": {"Node": "n_2"}}}]}
    assert plan_to_json(g.plan()) == data


def test_stages_cut_on_host_and_trained():
    g = Graph.somatize(N().named("a") >> N().named("b").at("gpu") >> N().named("c"))
    assert stages(g) == [["a"], ["b"], ["c"]]
    g = Graph.somatize(N().named("a") >> N().named("b") >> N().named("c"))
    assert stages(g) == [["a", "b", "c"]]
    assert stages(g, {"b"}) == [["a"], ["b"], ["c"]]
    # side by side on two hosts is still one stage
    g = Graph.somatize(N().named("a").at("x") | N().named("b").at("y"))
    assert stages(g) == [["a", "b"]]


@st.composite
def dags(draw):
    size = draw(st.integers(1, 14))
    edges = [(a, b) for b in range(size) for a in range(b) if draw(st.booleans())]
    hosts = [draw(st.sampled_from([None, "h1", "h2"])) for _ in range(size)]
    trained = {i for i in range(size) if draw(st.integers(0, 3)) == 0}
    return size, edges, hosts, trained


@settings(max_examples=200, deadline=None)
@given(dags())
def test_stage_properties(dag):
    size, edges, hosts, trained = dag
    g = Graph()
    for i in range(size):
        g.node(f"n{i}", N())
        if hosts[i]:
            g.place_at(f"n{i}", hosts[i])
    for a, b in edges:
        g.edge(f"n{a}", f"n{b}")
    names = {f"n{i}" for i in trained}
    grouped = stages(g, names)
    stage_of = {n: k for k, nodes in enumerate(grouped) for n in nodes}
    assert sorted(stage_of) == sorted(g.nodes())
    assert all(grouped)  # no empty stage

    def cut(p, c):
        return (g.hosts().get(p), p in names) != (g.hosts().get(c), c in names)

    for p, c in g.edges():
        assert stage_of[p] <= stage_of[c], "no edge goes backwards"
        if cut(p, c):
            assert stage_of[p] < stage_of[c], "a cut edge crosses a stage boundary"
        # ...and no cut edge stays inside a stage
        if stage_of[p] == stage_of[c]:
            assert not cut(p, c)
    # the plan covers every node exactly once, each after its predecessors
    order = [n for step in g.plan().steps for n in _ids(step)]
    assert sorted(order) == sorted(g.nodes())
    at = {n: i for i, n in enumerate(order)}
    assert all(at[p] < at[c] for p, c in g.edges())


def _ids(step):
    if isinstance(step, P):
        return [step.id]
    if isinstance(step, Remote):
        return _ids(step.plan)
    return [n for s in step.steps for n in _ids(s)]
