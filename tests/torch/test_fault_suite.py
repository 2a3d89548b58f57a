"""The seeded-fault suite: nets broken on purpose, trained and recorded for real, and
diagnosed from the store alone — in this process and in one where torch cannot load.

Each fault is one line of difference from a clean run, seeded five ways; twenty clean
runs vary the seed, the sizes, the depth, the activation, the task and the optimizer.
Targets (issue 9): the right finding on the right ``where`` in at least 95% of the
faulty runs, and a finding on at most 5% of the clean ones.

How each fault is seeded, and what counts as finding it:

==============  =====================================================  ====================
fault           the one change                                         found as
==============  =====================================================  ====================
lr_x100         SGD with momentum (the clean runs' setting), its       exploding,
                learning rate times 100                                update_too_large or
                                                                       nonfinite, on a node
                                                                       holding weights
sigmoid_x0.01   eight sigmoid layers, every weight and bias x 0.01     vanishing or
                                                                       saturated, in the
                                                                       stack (l1 to l7)
bias_minus_10   the second ReLU layer's bias set to -10                dying, on l2
lr_0_group      the second layer in a param group of its own, lr=0     not_updating, on l2
                (the Trainer refuses parameters no optimizer holds,
                so this is how "left out of the optimizer" is said
                in a way it accepts)
inputs_x255     a tanh first layer, no normalisation, inputs x 255     saturated or
                                                                       exploding, on l1
init_x6         (beyond the issue's five, so that ``exploding`` is     exploding, in the
                seen on a run) eight ReLU layers, weights x 6          stack (l1 to l7)
==============  =====================================================  ====================

Adam with its learning rate times 100 is trained too and shown in the table, but not
counted: Adam divides each step by the gradient's own scale, so on these nets it does
not explode — its update ratio starts near 0.5–0.9 and falls below a clean SGD run's
within four steps, and the rules, set so that clean runs stay quiet, do not call it
(on some seeds it kills a ReLU layer, which is found as ``dying``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import torch

import torch.nn.functional as F

import somatize
from somatize import Graph, Node, Opaque
from somatize.health import diagnose
from somatize.health._rules import findings_of
from somatize.record import Recorder
from somatize.store import Store
from somatize.torch import Trainer, parameters

SRC = os.path.dirname(os.path.dirname(somatize.__file__))
STEPS = 60
ROWS = 32
INPUTS = 8
ACTIVATIONS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}


class Dense(Node):
    """One layer as one node: a Linear and its activation."""

    def __init__(self, fan_in, fan_out, act="relu"):
        self.layer = torch.nn.Linear(fan_in, fan_out)
        self.act = ACTIVATIONS[act]()

    def forward(self, x, ctx):
        return Opaque(self.act(self.layer(x)))

    def parameters(self):
        return list(self.layer.parameters())


class Out(Node):
    def __init__(self, fan_in, fan_out):
        self.layer = torch.nn.Linear(fan_in, fan_out)

    def forward(self, x, ctx):
        return Opaque(self.layer(x))

    def parameters(self):
        return list(self.layer.parameters())


def net(seed, widths, act="relu", outputs=1):
    """``l1 >> l2 >> ... >> out``, weights drawn from ``seed``."""
    torch.manual_seed(seed)
    layers, fan_in = [], INPUTS
    for at, width in enumerate(widths, 1):
        layers.append(Dense(fan_in, width, act).named(f"l{at}"))
        fan_in = width
    expression = layers[0]
    for layer in layers[1:]:
        expression = expression >> layer
    return Graph.somatize(expression >> Out(fan_in, outputs).named("out"))


def data(seed, task="regression", scale=1.0):
    """Batches from a fixed random teacher: a smooth regression or four classes."""
    generator = torch.Generator().manual_seed(seed + 10_000)
    first = torch.randn(INPUTS, 16, generator=generator)
    second = torch.randn(16, 4 if task == "classes" else 1, generator=generator)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(ROWS, INPUTS, generator=generator)
        y = torch.tanh(x @ first) @ second
        if task == "classes":
            y = y.argmax(dim=1)
        else:
            y = y + 0.1 * torch.randn(ROWS, 1, generator=generator)
        batches.append((x * scale, y))
    return batches


# -- the runs -----------------------------------------------------------------------------
def clean(seed):
    """Run ``seed`` of the twenty clean ones: everything varied, nothing broken."""
    widths = [(16, 16), (32, 32, 32), (64, 32), (32, 32, 32, 32), (24, 48, 24)][seed % 5]
    act = ("relu", "tanh")[(seed // 5) % 2]
    task = ("regression", "classes")[(seed // 2) % 2]
    g = net(seed, widths, act, outputs=4 if task == "classes" else 1)
    if seed % 3 == 0:
        optimizer = torch.optim.SGD(parameters(g), lr=0.02, momentum=0.9)
    elif seed % 3 == 1:
        optimizer = torch.optim.Adam(parameters(g), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(parameters(g), lr=0.05)
    return g, optimizer, task, data(seed, task)


def lr_x100(seed):
    g = net(seed, (32, 32, 32))
    return g, torch.optim.SGD(parameters(g), lr=0.02 * 100, momentum=0.9), "regression", data(seed)


def adam_lr_x100(seed):
    g = net(seed, (32, 32, 32))
    return g, torch.optim.Adam(parameters(g), lr=1e-3 * 100), "regression", data(seed)


def sigmoid_x001(seed):
    g = net(seed, (32,) * 8, "sigmoid")
    with torch.no_grad():
        for p in parameters(g):
            p.mul_(0.01)
    return g, torch.optim.Adam(parameters(g), lr=1e-3), "regression", data(seed)


def bias_minus_10(seed):
    g = net(seed, (32, 32, 32))
    with torch.no_grad():
        g.implementation("l2").layer.bias.fill_(-10.0)
    return g, torch.optim.Adam(parameters(g), lr=1e-3), "regression", data(seed)


def lr_0_group(seed):
    g = net(seed, (32, 32, 32))
    left = g.implementation("l2").parameters()
    rest = parameters(g, without=["l2"])
    optimizer = torch.optim.Adam([{"params": rest}, {"params": left, "lr": 0.0}], lr=1e-3)
    return g, optimizer, "regression", data(seed)


def inputs_x255(seed):
    g = net(seed, (32, 32), "relu")
    g.implementation("l1").act = torch.nn.Tanh()
    return g, torch.optim.Adam(parameters(g), lr=1e-3), "regression", data(seed, scale=255.0)


def init_x6(seed):
    g = net(seed, (32,) * 8)
    with torch.no_grad():
        for node_id in g.nodes():
            g.implementation(node_id).layer.weight.mul_(6.0)
    return g, torch.optim.SGD(parameters(g), lr=1e-5), "regression", data(seed)


FAULTS = {
    "lr_x100": (lr_x100, {"exploding", "update_too_large", "nonfinite"}, None),
    "sigmoid_x0.01": (sigmoid_x001, {"vanishing", "saturated"}, {f"l{i}" for i in range(1, 8)}),
    "bias_minus_10": (bias_minus_10, {"dying"}, {"l2"}),
    "lr_0_group": (lr_0_group, {"not_updating"}, {"l2"}),
    "inputs_x255": (inputs_x255, {"saturated", "exploding"}, {"l1"}),
    "init_x6": (init_x6, {"exploding"}, {f"l{i}" for i in range(1, 8)}),
}
SHOWN = {"adam_lr_x100": (adam_lr_x100, {"exploding", "update_too_large", "nonfinite"}, None)}
SEEDS = range(5)
CLEAN = range(20)


def train(build, seed, store, run):
    """One recorded, audited training run; answers the health facts it said."""
    g, optimizer, task, batches = build(seed)
    objective = F.cross_entropy if task == "classes" else F.mse_loss
    said = []
    recorder = Recorder(store, run=run, summarising=["loss"])
    trainer = Trainer(g, objective=objective, optimizer=optimizer, auditing=True,
                      watching=[recorder, said.append])
    for batch in batches:
        trainer.step(batch)
    trainer.close()
    recorder.close()
    return [fact for fact in said if fact["fact"] == "health"]


def right(findings, whats, wheres, g_nodes):
    """Whether any finding is one of ``whats`` on one of ``wheres`` (any node that holds
    weights when ``wheres`` is None)."""
    return any(f.what in whats and (f.where.split(".")[0] in (wheres or g_nodes))
               for f in findings)


# -- the suite ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every run trained and recorded once: ``{run: (kind, seed, findings, facts)}``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    where = str(tmp_path_factory.mktemp("fault-suite"))
    store = Store(where, durable=False)
    runs = {}
    try:
        for kind, (build, _, _) in [*FAULTS.items(), *SHOWN.items()]:
            for seed in SEEDS:
                name = f"{kind}-{seed}"
                said = train(build, seed, store, name)
                runs[name] = (kind, seed, diagnose(store, name), said)
        for seed in CLEAN:
            name = f"clean-{seed}"
            said = train(clean, seed, store, name)
            runs[name] = ("clean", seed, diagnose(store, name), said)
    finally:
        torch.set_num_threads(before)
    return where, runs


def table(runs):
    """Per kind of run: how many had the right finding, how it was found (each what,
    in how many runs, on which wheres) and what else was found; and the two shares."""
    rows, found_all, total = [], 0, 0
    for kind, (build, whats, wheres) in [*FAULTS.items(), *SHOWN.items()]:
        mine = [(name, found) for name, (k, _, found, _) in runs.items() if k == kind]
        nodes = set().union(*(_node_wheres(runs[name][3]) for name, _ in mine))
        hits = [name for name, found in mine if right(found, whats, wheres, nodes)]
        on_target = [f for _, found in mine for f in found if right([f], whats, wheres, nodes)]
        rows.append((kind, len(hits), len(mine), _how(mine, on_target.__contains__),
                     _how(mine, lambda f, whats=whats: f.what not in whats)))
        if kind in FAULTS:
            found_all, total = found_all + len(hits), total + len(mine)
    clean_runs = [(name, found) for name, (k, _, found, _) in runs.items() if k == "clean"]
    noisy = [name for name, found in clean_runs if found]
    rows.append(("clean (any finding)", len(noisy), len(clean_runs), "-",
                 _how(clean_runs, lambda f: True)))
    return rows, found_all / total, len(noisy) / len(clean_runs)


def _how(runs, chosen):
    """``what ×runs @wheres`` for the findings ``chosen`` picks, or ``-``."""
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
    return {f["where"] for f in said if "weight_norm" in f and "." not in f["where"]}


def test_the_right_finding_on_the_right_where_and_clean_runs_stay_quiet(suite, capsys):
    _, runs = suite
    rows, found, false = table(runs)
    with capsys.disabled():
        print("\n\nseeded-fault suite (5 seeds each; 20 clean runs)")
        print(f"{'fault':20} {'found':>7}  {'as':58} also found")
        for kind, hits, total, how, other in rows:
            print(f"{kind:20} {hits:>3}/{total:<3}  {how:58} {other}")
        print(f"found in {found:.0%} of faulty runs; a finding on {false:.0%} of clean runs\n")
    assert found >= 0.95
    assert false <= 0.05


def test_the_record_holds_everything_the_diagnosis_needs(suite):
    _, runs = suite
    for name, (_, _, from_store, said) in runs.items():
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
    out = {run: [f.as_dict() for f in diagnose(store, run)] for run in sys.argv[2:]}
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print(json.dumps(out))
""")


def test_the_diagnosis_is_reproduced_from_the_store_alone_in_a_process_without_torch(suite):
    where, runs = suite
    done = subprocess.run([sys.executable, "-c", BLOCKED, where, *runs], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC},
                          check=False)
    assert done.returncode == 0, done.stderr
    elsewhere = json.loads(done.stdout)
    here = {run: [f.as_dict() for f in found] for run, (_, _, found, _) in runs.items()}
    assert elsewhere == json.loads(json.dumps(here))
    assert sum(len(found) for found in elsewhere.values()) > 0
