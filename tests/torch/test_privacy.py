"""What a worker could learn from a trained cut, measured and defended (``_privacy``).

Each measure is held to an independent computation on what the worker actually
received, written down by the body's trainer on the worker (``privnets.Recording``):
scikit-learn's ``roc_auc_score`` for the attacks, the textbook distance correlation in
numpy. Each defence is seen to change what arrives there and nothing kept here, NoPeek
is held to the same objective trained in one piece in plain torch, and seeded runs
repeat ``==``."""

import re
import warnings

import numpy as np
import pytest
import torch
from privnets import Dense, Recording

from somatize import DeclarationError, Graph, Worker
from somatize.torch import Audit, Protection, Split, Trainer, parameters
from somatize.torch._privacy import distance_correlation, roc_auc

sklearn_metrics = pytest.importorskip("sklearn.metrics", reason="the reference AUC is sklearn's")
cross_entropy = torch.nn.functional.cross_entropy


@pytest.fixture(scope="module")
def worker():
    with Worker.generic(mode="network", send=["privnets"]) as w:
        yield w


def data(name, rows=96):
    from sklearn.datasets import load_breast_cancer, load_digits

    x, y = (load_breast_cancer if name == "cancer" else load_digits)(return_X_y=True)
    x = torch.tensor(x[:rows], dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    return x, torch.tensor(y[:rows])


def batches(x, y, size=32):
    return [(x[k:k + size], y[k:k + size]) for k in range(0, len(x), size)]


def net(inputs, classes, host="gpu"):
    torch.manual_seed(0)
    encoder, body = Dense(inputs, 12).named("encoder"), Dense(12, 10).named("body")
    return Graph.somatize(encoder >> (body.at(host) if host else body)
                          >> Dense(10, classes, relu=False).named("head"))


def trained(worker, path, name="cancer", protection=None, seed=None, audit=True,
            evaluating=False):
    x, y = data(name)
    g = net(x.shape[1], int(y.max()) + 1)
    trains = {"body": Recording(torch.optim.SGD, path, lr=0.1)}
    seen = []
    t = Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                auditing=Audit(leaks=True) if audit else None,
                watching=seen.append if audit else None,
                protecting={"body": protection} if protection else None)
    if seed is not None:
        t.seed(seed)
    losses = []
    for b in batches(x, y):
        losses.append(t.step(b))
        if evaluating:  # between steps, as a validation would
            t.evaluate([b])
    weights = t.export()
    t.close()
    return {"losses": losses, "weights": weights, "arrived": torch.load(path), "said":
            [f for f in seen if f["fact"] == "health" and "input_dcor" in f], "x": x, "y": y,
            "graph": next((f for f in seen if f["fact"] == "graph"), None)}


# -- independent computations -------------------------------------------------------------
def norm_auc_by_sklearn(g, y):
    norms = g.double().norm(dim=1).numpy()
    classes, counts = np.unique(y, return_counts=True)
    if len(classes) == 2:  # the rarer class is the positive one, the larger on a tie
        classes = [classes[1] if counts[1] <= counts[0] else classes[0]]
    return float(np.mean([sklearn_metrics.roc_auc_score(y == c, norms) for c in classes]))


def direction_auc_by_sklearn(g, y):
    g = g.double().numpy()
    unit = g / np.linalg.norm(g, axis=1, keepdims=True)
    aucs = []
    for known in range(len(g)):
        others = np.arange(len(g)) != known
        same = y[others] == y[known]
        if same.all() or not same.any():
            continue
        aucs.append(sklearn_metrics.roc_auc_score(same, unit[others] @ unit[known]))
    return float(np.mean(aucs))


def class_norm_aucs_by_sklearn(g, y):
    norms = g.double().norm(dim=1).numpy()
    return [[int(c), float(sklearn_metrics.roc_auc_score(y == c, norms))] for c in np.unique(y)]


def corrected_dcor_by_numpy(x, y):
    """Székely and Rizzo (2014), written from the paper: U-centred distances, their
    inner product over i != j divided by n(n - 3), the ratio's square root (0 if < 0)."""
    def u_centred(a):
        a = a.reshape(len(a), -1).astype(np.float64)
        n = len(a)
        d = np.sqrt(((a[:, None, :] - a[None, :, :]) ** 2).sum(-1))
        u = d - d.sum(0) / (n - 2) - d.sum(1)[:, None] / (n - 2) + d.sum() / ((n - 1) * (n - 2))
        np.fill_diagonal(u, 0)
        return u
    a, b = u_centred(x), u_centred(y)
    n = len(a)
    def inner(p, q):
        return (p * q).sum() / (n * (n - 3))
    return float(np.sqrt(max(inner(a, b) / np.sqrt(inner(a, a) * inner(b, b)), 0)))


def dcor_by_numpy(x, y):
    def centred(a):
        a = a.reshape(len(a), -1).astype(np.float64)
        d = np.sqrt(((a[:, None, :] - a[None, :, :]) ** 2).sum(-1))
        return d - d.mean(0) - d.mean(1)[:, None] + d.mean()
    a, b = centred(x), centred(y)
    return float(np.sqrt((a * b).mean() / np.sqrt((a * a).mean() * (b * b).mean())))


# -- the measures ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, protection", [("cancer", None), ("digits", None),
                                              ("cancer", Protection(noise=0.3, gradients=1.0))])
def test_each_measure_agrees_with_sklearn_on_what_the_worker_received(worker, tmp_path,
                                                                       name, protection):
    run = trained(worker, tmp_path / "arrived.pt", name, protection, seed=0)
    arrived, said = run["arrived"], run["said"]
    assert [f["step"] for f in said] == [1, 2, 3] and all(f["where"] == "body" for f in said)
    for k, ((x, y), fact) in enumerate(zip(batches(run["x"], run["y"]), said)):
        g, a = arrived["gradients"][k], arrived["inputs"][k]
        assert fact["leak_norm_auc"] == pytest.approx(norm_auc_by_sklearn(g, y.numpy()), abs=1e-12)
        assert fact["leak_direction_auc"] == pytest.approx(direction_auc_by_sklearn(g, y.numpy()),
                                                           abs=1e-12)
        assert fact["input_dcor"] == pytest.approx(dcor_by_numpy(x.numpy(), a.numpy()), abs=1e-9)
        assert fact["input_dcor_corrected"] == pytest.approx(
            corrected_dcor_by_numpy(x.numpy(), a.numpy()), abs=1e-9)
        if name == "digits":  # each class's own, for the run's worst class
            ours, theirs = fact["leak_norm_classes"], class_norm_aucs_by_sklearn(g, y.numpy())
            assert [c for c, _ in ours] == [c for c, _ in theirs]
            assert [a for _, a in ours] == pytest.approx([a for _, a in theirs], abs=1e-12)
        else:
            assert "leak_norm_classes" not in fact
    if protection is None and name == "cancer":  # the paper's attack, undefended: it works
        assert max(f["leak_direction_auc"] for f in said) > 0.9


def test_roc_auc_counts_ties_as_sklearn_does():
    scores = torch.tensor([0.1, 0.4, 0.4, 0.4, 0.9, 0.2, 0.2, 0.7])
    positive = torch.tensor([0, 1, 0, 1, 1, 0, 1, 0]).bool()
    assert roc_auc(scores, positive) == pytest.approx(
        sklearn_metrics.roc_auc_score(positive.numpy(), scores.numpy()), abs=1e-15)
    assert roc_auc(scores, torch.ones(8).bool()) is None


def test_a_run_s_norm_leak_is_its_worst_class_averaged_over_its_steps():
    from somatize.torch._privacy import run_norm_leak

    # class 2's norms stand out in every step and class 1's hide: the average over
    # classes reads them as cancelling, the worst class does not
    g = torch.Generator().manual_seed(3)
    facts, tallies = [], {}
    for _ in range(40):
        y = torch.arange(30) % 3
        grads = torch.randn(30, 8, generator=g) * (1 + 0.6 * (y == 2) - 0.4 * (y == 1))[:, None]
        fact = {"leak_norm_auc": 0.0, "leak_norm_classes": class_norm_aucs_by_sklearn(grads, y.numpy())}
        facts.append(fact)
        for label, auc in fact["leak_norm_classes"]:
            tallies.setdefault(label, []).append(auc)
    worst = max(max(np.mean(v), 1 - np.mean(v)) for v in tallies.values())
    assert run_norm_leak(facts) == pytest.approx(worst, abs=1e-12) and worst > 0.8
    # two classes: the steps' AUCs averaged, read either way round
    assert run_norm_leak([{"leak_norm_auc": 0.2}, {"leak_norm_auc": 0.3}]) == pytest.approx(0.75)
    assert run_norm_leak([{"input_dcor": 0.5}]) is None


def test_the_corrected_distance_correlation_is_szekely_rizzo_s_and_reads_0_when_independent():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 30, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(30, 8, generator=g, dtype=torch.float64)).tanh()
    y[3] = y[4]
    assert float(distance_correlation(x, y, corrected=True)) == pytest.approx(
        corrected_dcor_by_numpy(x.numpy(), y.numpy()), abs=1e-12)
    apart = [torch.randn(32, 32, generator=g, dtype=torch.float64) for _ in range(50)]
    textbook = np.mean([float(distance_correlation(x, a)) for a in apart])
    corrected = np.mean([float(distance_correlation(x, a, corrected=True)) for a in apart])
    assert textbook > 0.6 and corrected < 0.15  # the textbook one's bias, at a batch of 32
    y.requires_grad_(True)
    distance_correlation(x, y, corrected=True).backward()
    assert torch.isfinite(y.grad).all() and y.grad.abs().sum() > 0


def test_distance_correlation_is_the_textbook_one_and_has_a_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 5, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(5, 3, generator=g, dtype=torch.float64)).tanh()
    y[3] = y[4]  # two equal rows: the distance's square root must not make a NaN
    assert float(distance_correlation(x, y)) == pytest.approx(dcor_by_numpy(x.numpy(), y.numpy()),
                                                              abs=1e-12)
    y.requires_grad_(True)
    distance_correlation(x, y).backward()
    assert torch.isfinite(y.grad).all() and y.grad.abs().sum() > 0


# -- the defences -----------------------------------------------------------------------------
def test_each_defence_changes_what_arrives_and_nothing_kept_here(worker, tmp_path):
    plain = trained(worker, tmp_path / "plain.pt", seed=0)
    noisy = trained(worker, tmp_path / "noisy.pt", protection=Protection(noise=0.5), seed=0)
    blurred = trained(worker, tmp_path / "blurred.pt", protection=Protection(gradients=2.0), seed=0)
    # the first step's encoder output is made by the same weights in all three runs:
    # the noise is on what arrives there, not on what is kept here
    sent, got = plain["arrived"]["inputs"][0], noisy["arrived"]["inputs"][0]
    drawn = got - sent
    assert not torch.equal(got, sent)
    assert abs(float(drawn.std()) - 0.5) < 0.05 and abs(float(drawn.mean())) < 0.05
    # only the gradient sent changed: the same first activation arrived, and the head,
    # trained here from what stays here, took the same first step
    assert torch.equal(blurred["arrived"]["inputs"][0], sent)
    assert not torch.equal(blurred["arrived"]["gradients"][0], plain["arrived"]["gradients"][0])
    assert blurred["losses"][0] == plain["losses"][0]
    assert noisy["graph"]["protected"] == {"body": {"noise": 0.5}}
    assert blurred["graph"]["protected"] == {"body": {"gradients": 2.0}}


def test_the_gradient_defence_is_unbiased_and_aimed_where_the_classes_part():
    from somatize.torch._privacy import noisy_gradient

    g = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(32) % 3
    g[labels == 1] += 3.0  # the classes' gradients point apart, as a head's do
    g[0] *= 20
    drawn = torch.stack([noisy_gradient(g, 1.0, torch.Generator().manual_seed(s), labels)
                         for s in range(4000)])
    noise = drawn - g
    means = torch.stack([g[labels == c].mean(0) for c in range(3)])
    apart = means - means.mean(0)
    scale = float(apart.norm(dim=1).max())
    assert torch.allclose(noise.mean(0), torch.zeros_like(g), atol=0.1 * scale)  # unbiased
    added = noise.pow(2).sum(-1).mean(0)  # every row gets as much, whatever its own norm
    expected = 2 * float(apart.pow(2).sum())  # directed, and isotropic as large
    assert float(added.min()) > 0.9 * expected and float(added.max()) < 1.1 * expected
    basis = torch.linalg.qr(apart.T).Q[:, :2]
    along = (noise @ basis).pow(2).sum(-1).mean()
    # the directed half all along the two directions, and 2/10 of the isotropic half
    assert float(along) == pytest.approx(float(apart.pow(2).sum()) * (1 + 2 / 10), rel=0.05)


def test_without_labels_the_gradient_defence_evens_the_norms():
    from somatize.torch._privacy import noisy_gradient

    g = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    g[0] *= 20  # one example's gradient dominates: the others get noise up to its norm
    drawn = torch.stack([noisy_gradient(g, 1.0, torch.Generator().manual_seed(s))
                         for s in range(4000)])
    scale = float(g.norm(dim=1).max())
    assert torch.allclose(drawn.mean(0), g, atol=0.06 * scale)
    norms = drawn.pow(2).sum(-1).mean(0)
    assert float(norms.max() / norms.min()) < 1.15


def plain_torch_nopeek(x, y, weight, steps, penalty):
    """The NoPeek objective trained in one piece, plain torch: the model as three
    Linear layers with the same initial weights as ``net``."""
    torch.manual_seed(0)
    encoder, body, head = torch.nn.Linear(30, 12), torch.nn.Linear(12, 10), torch.nn.Linear(10, 2)
    optimizer = torch.optim.SGD([*encoder.parameters(), *body.parameters(), *head.parameters()],
                                lr=0.1)
    losses = []
    for xb, yb in steps:
        optimizer.zero_grad()
        sent = torch.relu(encoder(xb))
        out = head(torch.relu(body(sent)))
        rows = xb.reshape(len(xb), -1)
        loss = cross_entropy(out, yb) + weight * penalty(rows, sent)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {"encoder": encoder, "body": body, "head": head}


def _dcor_plain(x, y):
    def centred(a):
        d = torch.cdist(a, a, compute_mode="donot_use_mm_for_euclid_dist")
        return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()
    a, b = centred(x), centred(y)
    return ((a * b).mean() / ((a * a).mean() * (b * b).mean()).sqrt()).sqrt()


def _corrected_squared_plain(x, y):
    """Székely and Rizzo's bias-corrected dCor², U-centred, in plain torch."""
    def u_centred(a):
        n = len(a)
        d = torch.cdist(a, a, compute_mode="donot_use_mm_for_euclid_dist")
        u = (d - d.sum(0, keepdim=True) / (n - 2) - d.sum(1, keepdim=True) / (n - 2)
             + d.sum() / ((n - 1) * (n - 2)))
        return u - torch.diag(torch.diagonal(u))
    a, b = u_centred(x), u_centred(y)
    return (a * b).sum() / ((a * a).sum() * (b * b).sum()).sqrt()


@pytest.mark.parametrize("dcor, penalty", [("textbook", _dcor_plain),
                                           ("corrected", _corrected_squared_plain)])
def test_nopeek_trains_what_the_same_objective_trains_in_one_piece(worker, tmp_path, dcor,
                                                                    penalty):
    x, y = data("cancer")
    run = trained(worker, tmp_path / "nopeek.pt", protection=Protection(nopeek=0.7, dcor=dcor),
                  seed=0)
    losses, modules = plain_torch_nopeek(x, y, 0.7, batches(x, y), penalty)
    assert run["losses"] == pytest.approx(losses, rel=1e-5)
    for node, module in modules.items():
        for key, value in module.state_dict().items():
            assert torch.allclose(run["weights"][node][f"lin.{key}"], value, atol=1e-6), (node, key)


def test_seeded_runs_repeat_and_another_seed_does_not(worker, tmp_path):
    every = Protection(noise=0.2, nopeek=0.5, gradients=1.0)
    one = trained(worker, tmp_path / "a.pt", protection=every, seed=7)
    two = trained(worker, tmp_path / "b.pt", protection=every, seed=7)
    other = trained(worker, tmp_path / "c.pt", protection=every, seed=8)
    assert one["losses"] == two["losses"] and one["said"] == two["said"]
    assert all(torch.equal(a, b) for a, b in zip(one["arrived"]["gradients"],
                                                 two["arrived"]["gradients"]))
    assert not torch.equal(one["arrived"]["inputs"][0], other["arrived"]["inputs"][0])


def test_evaluating_between_protected_steps_changes_nothing_that_follows(worker, tmp_path):
    every = Protection(noise=0.2, nopeek=0.5, gradients=1.0)
    never = trained(worker, tmp_path / "a.pt", protection=every, seed=7)
    evaluated = trained(worker, tmp_path / "b.pt", protection=every, seed=7, evaluating=True)
    assert evaluated["losses"] == never["losses"] and evaluated["said"] == never["said"]
    assert all(torch.equal(evaluated["weights"][n][k], never["weights"][n][k])
               for n in never["weights"] for k in never["weights"][n])


def protected_trainer(worker, protection, seed):
    g = net(30, 2)
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2),
                protecting={"body": protection} if protection else None)
    t.seed(seed)
    return t


def test_a_resumed_protected_run_goes_on_as_one_never_interrupted(worker, tmp_path):
    from somatize import Store

    every = Protection(noise=0.2, nopeek=0.5, gradients=1.0)
    steps = batches(*data("cancer", rows=128))
    never = protected_trainer(worker, every, seed=7)
    losses = [never.step(b) for b in steps]
    never.close()
    store = Store(str(tmp_path / "store"))
    first = protected_trainer(worker, every, seed=7)
    for b in steps[:2]:
        first.step(b)
    first.checkpoint(store, "ck")
    first.close()
    # seeded alike, the resumed run's defences would draw the first steps' noise again
    resumed = protected_trainer(worker, every, seed=7)
    assert resumed.resume(store, "ck") == 2
    assert [resumed.step(b) for b in steps[2:]] == losses[2:]
    resumed.close()
    plain = protected_trainer(worker, None, seed=7)  # kept without protecting=
    plain.step(steps[0])
    plain.checkpoint(store, "plain")
    plain.close()
    with pytest.warns(UserWarning, match="no state of the defences' noise"):
        assert protected_trainer(worker, every, seed=7).resume(store, "plain") == 1


# -- what is refused, and what is said -------------------------------------------------------
def test_a_protection_of_a_node_not_trained_where_it_runs_is_refused(worker):
    g = net(30, 2)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    optimizer = torch.optim.SGD(parameters(g, without=trains), lr=0.1)
    with pytest.raises(DeclarationError, match=r"'head'.*trains= names 'body'"):
        Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                optimizer=optimizer, protecting={"head": Protection(noise=1.0)})
    with pytest.raises(TypeError, match=r"Protection\(noise=...\) is a finite number"):
        Protection(noise=-1)
    with pytest.raises(ValueError, match=r"'textbook' or 'corrected', not 'unbiased'"):
        Protection(nopeek=1.0, dcor="unbiased")
    with pytest.raises(TypeError, match="give a Protection"):
        Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                optimizer=optimizer, protecting={"body": 0.5})
    assert not g.frozen()  # refused before anything changed


def test_leaks_with_nothing_trained_where_it_runs_is_said_not_refused():
    g = net(30, 2, host=None)
    with pytest.warns(UserWarning, match="trains no node where it runs"):
        t = Trainer(g, objective=cross_entropy, auditing=Audit(leaks=True), watching=[].append,
                    optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    t.close()


def test_targets_that_are_not_labels_leave_the_aucs_out(worker, tmp_path):
    x = torch.randn(32, 30)
    g = net(30, 1)
    trains = {"body": Split(torch.optim.SGD, lr=0.1)}
    seen = []
    t = Trainer(g, objective=torch.nn.functional.mse_loss, trains=trains, workers={"gpu": worker},
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),
                auditing=Audit(leaks=True), watching=seen.append)
    with pytest.warns(UserWarning, match="class labels, and these are not"):
        t.step((x, torch.randn(32, 1)))
    said = [f for f in seen if f["fact"] == "health" and f["where"] == "body" and "input_dcor" in f]
    assert said and "leak_norm_auc" not in said[0]
    t.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Audit(leaks=False)


def test_the_health_rules_say_a_label_leak_and_a_defence_ends_it(worker, tmp_path):
    from somatize.health import findings_of

    x, y = data("cancer", rows=320)
    found = {}
    for label, protection in (("plain", None), ("protected", Protection(gradients=1.0))):
        g = net(30, 2)
        trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
        seen = []
        t = Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                    optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2),
                    auditing=Audit(leaks=True), watching=seen.append,
                    protecting={"body": protection} if protection else None)
        t.seed(0)
        for b in batches(x, y):
            t.step(b)
        t.close()
        found[label] = [f for f in findings_of(seen, window=5) if f.what == "label_leak"]
    (leak,) = found["plain"]
    assert leak.where == "body" and "protecting={'body': Protection(" in leak.advice
    assert found["protected"] == []


def test_what_leaks_is_in_the_record_and_somatize_health_says_it(worker, tmp_path):
    import subprocess
    import sys

    pytest.importorskip("plotly")
    from somatize import Store
    from somatize.health import panel, seen
    from somatize.record import Recorder

    x, y = data("cancer", rows=320)
    store = Store(str(tmp_path / "store"))
    g = net(30, 2)
    trains = {"body": Split(torch.optim.Adam, lr=1e-2)}
    t = Trainer(g, objective=cross_entropy, trains=trains, workers={"gpu": worker},
                optimizer=torch.optim.Adam(parameters(g, without=trains), lr=1e-2),
                auditing=Audit(leaks=True), watching=Recorder(store, run="leaky"))
    for b in batches(x, y):
        t.step(b)
    t.close()
    body = seen(store, "leaky")["body"]  # the worker's measures and the leaks, one where
    assert {"grad_norm", "leak_direction_auc", "leak_norm_auc", "input_dcor",
            "input_dcor_corrected"} <= set(body)
    titles = {a.text for a in panel(store, "leaky").layout.annotations}
    assert {"label leak AUC, direction attack", "distance correlation, input ↔ sent",
            "distance correlation, bias-corrected"} <= titles
    said = subprocess.run([sys.executable, "-m", "somatize", "health", str(tmp_path / "store"),
                           "leaky"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^body\s+label_leak\s+1\s", said, re.M) and "Protection(gradients=" in said
