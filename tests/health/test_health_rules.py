"""The rules of diagnose, one by one, on histories whose answer is known: a condition
held over a window is a finding and a spike is not; thresholds are arguments."""

import dataclasses
import math

import pytest
from healthruns import chain, recorded

from somatize.health import DEFAULTS, KINDS, Finding, diagnose, overlay
from somatize.health._rules import findings_of
from somatize.store import Store


def said(steps):
    """The facts an Audit would say for these steps (``chain``'s shape)."""
    return [{"fact": "health", "where": where, "step": number, **measures}
            for number, wheres in enumerate(steps, 1) for where, measures in wheres.items()]


def healthy(n):
    return {"act_zero": 0.5, "grad_norm": 1.0, "update_ratio": 1e-3, "nonfinite": 0}


def found(facts, **thresholds):
    return [(f.where, f.what, f.since) for f in findings_of(facts, **thresholds)]


def test_a_healthy_run_has_no_findings():
    assert found(said(chain(30, body=healthy, head=healthy))) == []


def test_a_condition_held_over_the_window_is_found_since_the_windows_first_step():
    zeros = lambda n: {**healthy(n), "act_zero": 0.95 if n >= 7 else 0.5}  # noqa: E731
    finding = findings_of(said(chain(30, body=zeros, head=healthy)))
    assert [(f.where, f.what, f.since) for f in finding] == [("body", "dying", 7)]
    evidence = finding[0].evidence
    assert evidence["measure"] == "act_zero" and evidence["threshold"] == 0.9
    assert evidence["steps"] == 24 and evidence["median"] == pytest.approx(0.95)


def test_a_spike_shorter_than_the_window_is_not_a_finding():
    spiky = lambda n: {**healthy(n), "act_zero": 0.99 if n % 5 else 0.2}  # noqa: E731
    assert found(said(chain(40, body=spiky, head=healthy))) == []
    assert found(said(chain(40, body=spiky, head=healthy)), window=4) == [("body", "dying", 1)]


def test_a_run_shorter_than_the_window_needs_the_condition_at_every_step():
    assert found(said(chain(3, body=lambda n: {**healthy(n), "act_saturated": 0.8},
                            head=healthy))) == [("body", "saturated", 1)]
    half = lambda n: {**healthy(n), "act_saturated": 0.8 if n > 1 else 0.1}  # noqa: E731
    assert found(said(chain(3, body=half, head=healthy))) == []


def test_a_nan_is_found_at_once_and_what_follows_it_is_left_to_it():
    after = lambda n: {**healthy(n), "nonfinite": 3 if n >= 5 else 0,  # noqa: E731
                       "update_ratio": math.inf if n >= 5 else 1e-3}
    finding = findings_of(said(chain(30, body=after, head=healthy)))
    assert [(f.where, f.what, f.since) for f in finding] == [("body", "nonfinite", 5)]
    assert finding[0].evidence["count"] == 3


def test_vanishing_and_exploding_are_measured_against_where_the_loss_enters():
    vanishing = lambda n: {**healthy(n), "grad_norm": 1e-5}  # noqa: E731
    exploding = lambda n: {**healthy(n), "grad_norm": 500.0}  # noqa: E731
    facts = said(chain(20, first=vanishing, second=exploding, head=healthy))
    assert found(facts) == [("first", "vanishing", 1), ("second", "exploding", 1)]
    # the loss end itself is the reference, never a finding of either kind
    tiny_everywhere = said(chain(20, body=vanishing, head=vanishing))
    assert found(tiny_everywhere) == []


def test_a_layer_that_does_not_move_or_moves_too_much():
    still = lambda n: {**healthy(n), "update_ratio": 0.0}  # noqa: E731
    wild = lambda n: {**healthy(n), "update_ratio": 0.8}  # noqa: E731
    assert found(said(chain(12, body=still, head=wild))) == [
        ("body", "not_updating", 1), ("head", "update_too_large", 1)]


def test_thresholds_are_arguments_and_change_the_answer_without_training():
    zeros = lambda n: {**healthy(n), "act_zero": 0.75}  # noqa: E731
    facts = said(chain(20, body=zeros, head=healthy))
    assert found(facts) == []
    assert found(facts, dying=0.7) == [("body", "dying", 1)]  # AUTOTRAINER's published 0.7
    with pytest.raises(TypeError, match="no threshold 'dead'.*dying"):
        findings_of(facts, dead=0.5)
    with pytest.raises(ValueError, match="window=2.5"):
        findings_of(facts, window=2.5)
    with pytest.raises(ValueError, match="dying=nan"):
        findings_of(facts, dying=float("nan"))


def test_every_kind_has_a_default_and_findings_come_in_step_then_where_order():
    assert set(KINDS) - {"nonfinite"} <= set(DEFAULTS) and "window" in DEFAULTS
    late = lambda n: {**healthy(n), "act_zero": 1.0 if n > 5 else 0.1}  # noqa: E731
    early = lambda n: {**healthy(n), "update_ratio": 0.0}  # noqa: E731
    assert found(said(chain(20, a=late, b=early, head=healthy))) == [
        ("b", "not_updating", 1), ("a", "dying", 6)]


def test_a_finding_is_frozen_plain_data_and_overlay_colours_the_node():
    finding = Finding("body.net.0", "dying", 3, {"measure": "act_zero"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.where = "head"
    assert finding.as_dict() == {"where": "body.net.0", "what": "dying", "since": 3,
                                 "evidence": {"measure": "act_zero"}, "advice": "",
                                 "node": "body", "path": "net.0"}  # made by hand: its first dot
    findings = [finding, Finding("body", "dying", 5), Finding("body.net.2", "vanishing", 1),
                Finding("head", "nonfinite", 9)]
    assert overlay(findings) == {"body": ["dying", "vanishing"], "head": ["nonfinite"]}
    with pytest.raises(TypeError, match="Findings"):
        overlay([("body", "dying")])


def test_a_node_id_with_dots_is_one_node_and_its_findings_and_advice_name_it():
    described = {"fact": "graph", "nodes": ["enc.v2", "layer.1", "head"], "optimizer": "SGD"}
    zeros = lambda n: {**healthy(n), "act_zero": 1.0}  # noqa: E731
    steps = chain(15, **{"enc.v2": zeros, "enc.v2.net.0": zeros, "layer.1": healthy,
                         "head": healthy})
    findings = findings_of([described] + said(steps))
    assert [(f.where, f.node, f.path, f.what) for f in findings] == [
        ("enc.v2", "enc.v2", "", "dying"), ("enc.v2.net.0", "enc.v2", "net.0", "dying")]
    assert overlay(findings) == {"enc.v2": ["dying"]}
    # Without the graph, a where is inside the shortest other where it starts with.
    alone = findings_of(said(steps))
    assert [(f.node, f.path) for f in alone] == [("enc.v2", ""), ("enc.v2", "net.0")]
    # vanishing is judged against the node where the loss enters: 'head', not 'layer'
    faint = lambda n: {**healthy(n), "grad_norm": 1e-6}  # noqa: E731
    quiet = findings_of([described] + said(chain(15, **{"layer.1": faint, "head": healthy})))
    assert [(f.where, f.what) for f in quiet] == [("layer.1", "vanishing")]
    assert "layer.1" in quiet[0].advice


def test_update_too_large_advice_fits_the_optimizer_the_run_said():
    big = lambda n: {**healthy(n), "update_ratio": 0.9}  # noqa: E731
    steps = said(chain(15, body=big, head=healthy))
    told = {name: findings_of([{"fact": "graph", "nodes": ["body", "head"],
                                "optimizer": name}] + steps)[0] for name in ("SGD", "Adam")}
    assert told["SGD"].evidence["optimizer"] == "SGD"
    assert "SGD" in told["SGD"].advice and "Adam" not in told["SGD"].advice
    assert "clip" in told["SGD"].advice and "Adam" in told["Adam"].advice
    unsaid = findings_of(steps)[0]
    assert "Adam" not in unsaid.advice and "optimizer" not in unsaid.evidence


def test_diagnose_reads_the_same_from_a_store(tmp_path):
    store = Store(str(tmp_path))
    zeros = lambda n: {**healthy(n), "act_zero": 1.0}  # noqa: E731
    recorded(store, "dead", chain(15, body=zeros, head=healthy))
    assert [(f.where, f.what) for f in diagnose(store, "dead")] == [("body", "dying")]
    assert diagnose(store, "dead", dying=1.01) == []


def test_a_share_of_channels_dead_through_the_window_is_dead_channels_per_group_too():
    dead = lambda n: {**healthy(n), "dead_channels": 3, "channels": 4}  # noqa: E731
    few = lambda n: {**healthy(n), "dead_channels": 1, "channels": 4}  # noqa: E731
    assert found(said(chain(12, conv=dead, other=few, head=healthy))) == [
        ("conv", "dead_channels", 1)]
    grouped = lambda n: {**healthy(n), "dead_channels": {"audio": 0, "text": 60},  # noqa: E731
                         "channels": {"audio": 64, "text": 64}}
    [finding] = findings_of(said(chain(12, conv=grouped, head=healthy)))
    assert finding.what == "dead_channels" and finding.evidence["worst"] == pytest.approx(60 / 64)
    assert "94% of conv's channels stayed 0" in finding.advice
    untold = lambda n: {**healthy(n), "dead_channels": 3}  # noqa: E731 (a record from before)
    assert found(said(chain(12, conv=untold, head=healthy))) == []


def test_weights_that_multiply_away_from_the_loss_end_are_an_update_too_large():
    def growing(n):  # Adam at a learning rate far too high: the weights pile up
        return {**healthy(n), "weight_norm": 1.2 ** n, "update_ratio": 0.2,
                "update_norm": 0.2 * 1.2 ** (n - 1)}
    steady = lambda n: {**healthy(n), "weight_norm": 1.0, "update_ratio": 1e-3,  # noqa: E731
                        "update_norm": 1e-3}
    [finding] = findings_of(said(chain(20, body=growing, head=steady)))
    assert (finding.where, finding.what, finding.since) == ("body", "update_too_large", 1)
    assert finding.evidence["measure"] == "weight_norm growth a step"
    assert finding.evidence["median"] == pytest.approx(0.2)
    assert "multiply in size" in finding.advice and "holding body" in finding.advice
    # where the loss enters, weights grow to the targets' scale: not a finding there
    assert found(said(chain(20, body=steady, head=growing))) == []
    assert found(said(chain(20, body=growing, head=steady)), weight_growth=0.3) == []


def test_every_finding_says_what_to_do_there():
    sick = {"dying": lambda n: {**healthy(n), "act_zero": 1.0},
            "saturated": lambda n: {**healthy(n), "act_saturated": 0.9},
            "not_updating": lambda n: {**healthy(n), "update_ratio": 0.0},
            "update_too_large": lambda n: {**healthy(n), "update_ratio": 0.9},
            "vanishing": lambda n: {**healthy(n), "grad_norm": 1e-6},
            "exploding": lambda n: {**healthy(n), "grad_norm": 1e4},
            "nonfinite": lambda n: {**healthy(n), "nonfinite": 2}}
    for what, measures in sick.items():
        [finding] = findings_of(said(chain(12, **{"body.net.0": measures, "head": healthy})))
        assert (finding.where, finding.what) == ("body.net.0", what)
        assert "body.net.0" in finding.advice and finding.advice.endswith("."), finding.advice
        assert str(finding).endswith(finding.advice)
    [left] = findings_of(said(chain(12, body=sick["not_updating"], head=healthy)))
    assert "not in the optimizer" in left.advice and "freeze(g, 'body')" in left.advice
    dead = lambda n: {**healthy(n), "act_zero": 1.0, "update_ratio": 0.0}  # noqa: E731
    [dying, still] = findings_of(said(chain(12, body=dead, head=healthy)))
    assert (dying.what, still.what, still.evidence["because"]) == ("dying", "not_updating",
                                                                   "dying")
    assert "its units are dead" in still.advice
    cut = lambda n: {**healthy(n), "grad_norm": 0.0, "update_ratio": 0.0}  # noqa: E731
    [still] = [f for f in findings_of(said(chain(12, body=cut, head=healthy)))
               if f.what == "not_updating"]
    assert "no gradient reaches them" in still.advice
    # weights an optimizer moves, by next to nothing (a run that has learnt its batches)
    crawl = lambda n: {**healthy(n), "grad_norm": 1e-9, "update_ratio": 1e-9}  # noqa: E731
    [still] = [f for f in findings_of(said(chain(12, body=crawl, head=healthy)))
               if f.what == "not_updating"]
    assert still.evidence["because"] == "barely"
    assert "not in the optimizer" not in still.advice and "learning rate" in still.advice


def test_the_runs_own_findings_come_after_the_nodes_and_colour_no_node():
    facts = said(chain(40, body=lambda n: {**healthy(n), "act_zero": 1.0}, head=healthy))
    facts += [{"fact": "loss", "value": math.log(4)} for _ in range(40)]
    findings = findings_of(facts)
    assert [(f.where, f.what, f.since) for f in findings] == [("body", "dying", 1),
                                                              ("loss", "plateau", 1)]
    assert overlay(findings) == {"body": ["dying"]}
