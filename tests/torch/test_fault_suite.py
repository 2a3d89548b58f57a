"""The seeded-fault suite: nets broken on purpose, trained and recorded for real, and
diagnosed from the store alone — in this process and in one where torch cannot load.

Four families (``faultnets``): multilayer perceptrons on a random teacher, and on
scikit-learn's digits a conv net, a recurrent net (GRU or LSTM) and a transformer
block. Each fault is one change to a family's base run, seeded five ways; the clean
runs vary the seed, the sizes, the kind of net and the optimizer. Targets (issues 9
and 18): the right finding on the right ``where`` in at least 95% of the faulty runs,
and a finding on at most 5% of the (at least 30) clean ones.

==================  ========================================  ==========================
fault               the one change                            found as
==================  ========================================  ==========================
lr_x100             SGD with momentum, learning rate x 100    exploding, update_too_large
                                                              or nonfinite on a node
                                                              with weights; diverging or
adam_lr_x100        Adam, learning rate x 100                 oscillating at the loss
sigmoid_x0.01       (MLP) eight sigmoid layers, every         vanishing or saturated, in
                    weight and bias x 0.01                    the stack (l1 to l7)
bias_minus_10 /     a ReLU layer's bias at -10 (MLP l2, conv  dying or dead_channels
dead_units          c2, recurrent mid, the transformer's      there
                    feed-forward, watched with inside=)
lr_0_group /        a node left out of the optimizer          not_updating, on it
not_in_optimizer    (see below)
inputs_x255         inputs x 255 into a bounded first layer   saturated (or, MLP,
                    (MLP and conv: tanh; recurrent: the GRU)  exploding) there
init_x6             (MLP) eight ReLU layers, weights x 6      exploding, in the stack
lr_small            Adam, learning rate / 1000                plateau at the loss, or
                                                              not_updating
random_labels       every label drawn at random               plateau at the loss
==================  ========================================  ==========================

A node left out of the optimizer: the families build an optimizer over every other
node and nothing frozen; a Trainer that refuses parameters no optimizer holds gets
the node in a param group of its own at lr=0 instead, and the table says which was
trained. The MLP's ``lr_0_group`` is the lr=0 group from the start.

The transformer's ``inputs_x255`` is trained and tabled but not counted: its block
normalises right after the first residual, so the run trains as a clean one does
and there is nothing for a rule to find (nor anything bounded to saturate).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

import torch

import faultnets

import somatize
from somatize import DeclarationError
from somatize.health import diagnose
from somatize.health._rules import findings_of
from somatize.record import Recorder
from somatize.store import Store
from somatize.torch import Trainer

SRC = os.path.dirname(os.path.dirname(somatize.__file__))
SEEDS = range(5)
CLEAN = {"mlp": range(20), "conv": range(9), "recurrent": range(9), "transformer": range(9)}
SUITES = faultnets.suites()


def train(seeded, store, run):
    """One recorded, audited training run; answers the health and loss facts it said,
    and how the optimizer was taken (``subset`` or ``lr=0 group`` for a node left out)."""
    g, optimizer, batches, objective, audit, fallback = seeded
    said = []
    recorder = Recorder(store, run=run, summarising=["loss"])
    how = "as given"
    with warnings.catch_warnings():  # a Trainer warns, once, about the node left out
        warnings.simplefilter("ignore", UserWarning)
        try:
            trainer = Trainer(g, objective=objective, optimizer=optimizer, auditing=audit,
                              watching=[recorder, said.append])
            how = "subset" if fallback is not None else how
        except DeclarationError:
            if fallback is None:
                raise
            trainer = Trainer(g, objective=objective, optimizer=fallback(), auditing=audit,
                              watching=[recorder, said.append])
            how = "lr=0 group"
        for batch in batches:
            trainer.step(batch)
    trainer.close()
    recorder.close()
    return [fact for fact in said if fact["fact"] in ("health", "loss", "graph")], how


def right(findings, whats, wheres, weighted):
    """Whether any finding is one of ``whats`` where it should be: on one of ``wheres``
    (by node), or, when ``wheres`` is None, on a node holding weights — or at the loss,
    for a run-level what."""
    for f in findings:
        if f.what not in whats:
            continue
        node = f.where if f.node is None else f.node  # a node and a path, kept apart
        if (wheres is not None and node in wheres) or (
                wheres is None and (node in weighted or (f.where == "loss"
                                                        and f.what in faultnets.RUN_LEVEL))):
            return True
    return False


# -- the suite ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    where = str(tmp_path_factory.mktemp("fault-suite"))
    return where, Store(where, durable=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trained(family, store):
    """Every run of one family trained and recorded once:
    ``{run: (kind, counted, findings, facts, how)}``."""
    clean, faults, shown = SUITES[family]
    runs = {}
    for counted, table in ((True, faults), (False, shown)):
        for kind, (build, _, _) in table.items():
            for seed in SEEDS:
                name = f"{family}.{kind}-{seed}"
                said, how = train(build(seed), store, name)
                runs[name] = (kind, counted, diagnose(store, name), said, how)
    for seed in CLEAN[family]:
        name = f"{family}.clean-{seed}"
        said, how = train(clean(seed), store, name)
        runs[name] = ("clean", True, diagnose(store, name), said, how)
    return runs


_TRAINED: dict[str, tuple[dict, float]] = {}


def family_runs(family, store):
    if family not in _TRAINED:
        if family != "mlp":
            pytest.importorskip("sklearn", reason="the digits come with scikit-learn")
        began = time.perf_counter()
        _TRAINED[family] = (trained(family, store[1]), time.perf_counter() - began)
    return _TRAINED[family][0]


def rows_of(family, runs):
    """Per fault of one family: ``(fault, counted, hits, total, as, also, how)``."""
    _, faults, shown = SUITES[family]
    rows = []
    for kind, (_, whats, wheres) in [*faults.items(), *shown.items()]:
        mine = [(name, found, said, how) for name, (k, _, found, said, how) in runs.items()
                if k == kind]
        weighted = set().union(*(_node_wheres(said) for _, _, said, _ in mine))
        hits = [name for name, found, _, _ in mine if right(found, whats, wheres, weighted)]
        on_target = [f for _, found, _, _ in mine for f in found
                     if right([f], whats, wheres, weighted)]
        listed = [(name, found) for name, found, _, _ in mine]
        hows = sorted({how for *_, how in mine} - {"as given"})
        rows.append((f"{family}.{kind}", kind in faults, len(hits), len(mine),
                     _how(listed, on_target.__contains__),
                     _how(listed, lambda f, whats=whats: f.what not in whats), ", ".join(hows)))
    clean_runs = [(name, found) for name, (k, _, found, _, _) in runs.items() if k == "clean"]
    noisy = [name for name, found in clean_runs if found]
    rows.append((f"{family}.clean (any finding)", True, len(noisy), len(clean_runs), "-",
                 _how(clean_runs, lambda f: True), ""))
    return rows


def _how(runs, chosen):
    """``what xruns @wheres`` for the findings ``chosen`` picks, or ``-``."""
    seen = {}
    for name, found in runs:
        for f in found:
            if chosen(f):
                entry = seen.setdefault(f.what, (set(), set()))
                entry[0].add(name)
                entry[1].add(f.where)
    return "; ".join(f"{what} x{len(names)} @{','.join(sorted(wheres))}"
                     for what, (names, wheres) in seen.items()) or "-"


def _node_wheres(said):
    return {f["where"] for f in said if f["fact"] == "health" and "weight_norm" in f
            and "." not in f["where"]}


def printed(rows, title):
    """The suite's table, printed where pytest keeps a test's output (shown with -rP or
    -s, and with a failure) and answered, to go into a failing assertion's message."""
    lines = [f"\n\n{title}", f"{'fault':34} {'found':>7}  {'as':60} also found"]
    for kind, counted, hits, total, how, other, taken in rows:
        mark = "" if counted else "  (shown, not counted)"
        said = f" [trained with a {taken}]" if taken else ""
        lines.append(f"{kind:34} {hits:>3}/{total:<3}  {how:60} {other}{said}{mark}")
    table = "\n".join(lines)
    print(table)
    return table


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SUITES))
def test_each_family_finds_its_faults_and_leaves_its_clean_runs_quiet(family, store):
    rows = rows_of(family, family_runs(family, store))  # the table is printed once, below
    faulty = [r for r in rows[:-1] if r[1]]
    assert sum(r[2] for r in faulty) >= 0.9 * sum(r[3] for r in faulty)
    assert rows[-1][2] <= max(1, 0.1 * rows[-1][3])


@pytest.mark.slow
def test_the_right_finding_on_the_right_where_and_clean_runs_stay_quiet(store):
    rows = [row for family in SUITES for row in rows_of(family, family_runs(family, store))]
    faulty = [r for r in rows if r[1] and "clean" not in r[0]]
    clean = [r for r in rows if "clean" in r[0]]
    found = sum(r[2] for r in faulty) / sum(r[3] for r in faulty)
    quiet = sum(r[3] for r in clean)
    false = sum(r[2] for r in clean) / quiet
    table = printed(rows, f"seeded-fault suite ({len(SEEDS)} seeds a fault; {quiet} clean runs)")
    took = ", ".join(f"{family} {t:.0f} s" for family, (_, t) in _TRAINED.items())
    print(f"found in {found:.1%} of {sum(r[3] for r in faulty)} faulty runs; a finding on "
          f"{false:.1%} of {quiet} clean runs; trained and diagnosed in {took}\n")
    assert quiet >= 30, table
    assert found >= 0.95, table
    assert false <= 0.05, table


@pytest.mark.slow
def test_the_record_holds_everything_the_diagnosis_needs(store):
    for family in SUITES:
        for name, (_, _, from_store, said, _) in family_runs(family, store).items():
            assert from_store == findings_of(said), name


BLOCKED = textwrap.dedent("""
    import json, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this process")
            return None

    sys.meta_path.insert(0, NoTorch())
    from somatize.health import diagnose
    from somatize.store import Store

    store = Store(sys.argv[1], durable=False)
    out = {run: [f.as_dict() for f in diagnose(store, run)] for run in sys.stdin.read().split()}
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_the_diagnosis_is_reproduced_from_the_store_alone_in_a_process_without_torch(store):
    runs = {name: found for family in SUITES
            for name, (_, _, found, _, _) in family_runs(family, store).items()}
    done = subprocess.run([sys.executable, "-c", BLOCKED, store[0]], input=" ".join(runs),
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC}, check=False)
    assert done.returncode == 0, done.stderr
    elsewhere = json.loads(done.stdout)
    here = {run: [f.as_dict() for f in found] for run, found in runs.items()}
    assert elsewhere == json.loads(json.dumps(here))
    assert sum(len(found) for found in elsewhere.values()) > 0
    assert any(f["where"] == "loss" for found in elsewhere.values() for f in found)
    assert all(f["advice"] for found in elsewhere.values() for f in found)


@pytest.mark.slow
def test_held_out_clean_runs_stay_quiet_and_advice_names_the_optimizer_used(tmp_path):
    """The slow-start GRU (a flat start the run then leaves is not a plateau) and a plain
    SGD GRU, trained for real: no findings; and an SGD run whose steps are far too large
    is advised about SGD, read from the record, not about Adam."""
    store = Store(str(tmp_path), durable=False)
    quiet = {}
    for name, build in faultnets.held_out().items():
        for seed in range(2):
            said, _ = train(build(seed), store, f"{name}-{seed}")
            losses = [f["value"] for f in said if f["fact"] == "loss"]
            assert min(losses[-10:]) < 0.9 * max(losses[:10]), (name, seed, losses[::10])
            quiet[f"{name}-{seed}"] = diagnose(store, f"{name}-{seed}")
    assert quiet == {run: [] for run in quiet}, quiet
    g = faultnets.two_class_gru(0)
    too_large = faultnets.Seeded(g, faultnets.sgd(g, 300.0), faultnets.halves(0, steps=30))
    train(too_large, store, "sgd-too-large")
    found = [f for f in diagnose(store, "sgd-too-large") if f.what == "update_too_large"]
    assert found, [(f.where, f.what) for f in diagnose(store, "sgd-too-large")]
    for finding in found:
        assert finding.evidence["optimizer"] == "SGD"
        assert "SGD" in finding.advice and "Adam" not in finding.advice
