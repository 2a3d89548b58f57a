"""The zero-cost proxies, each against its formula worked out by hand on a tiny network.

The network is 4 → 3 → 2 (Linear, ReLU, Linear) with weights set by hand and a batch
of three fixed rows, chosen so that no unit sits at zero and the three examples switch
different units on. Every expected number below is written out with torch arithmetic,
never by calling the module under test.
"""

import math

import pytest
import torch

from somatize import Graph, Node, Opaque
from somatize.torch._proxies import EVERY, proxies, proxy

F = torch.nn.functional

W1 = [[0.5, -0.2, 0.1, 0.3], [-0.4, 0.6, 0.2, -0.1], [0.3, 0.1, -0.5, 0.2]]
B1 = [0.1, -0.05, 0.02]
W2 = [[0.7, -0.3, 0.2], [-0.1, 0.4, 0.6]]
B2 = [0.05, -0.02]
X = [[1.0, 0.5, -0.5, 2.0], [-1.0, 1.5, 0.5, -0.5], [0.5, -1.0, 2.0, 1.0]]
Y = [[0.2, -0.1], [0.0, 0.3], [0.5, 0.1]]
K = 1e-5


class Tiny(Node):
    def __init__(self, norm=False):
        layers = [torch.nn.Linear(4, 3)] + ([torch.nn.BatchNorm1d(3)] if norm else [])
        self.net = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(3, 2))
        with torch.no_grad():
            self.net[0].weight.copy_(torch.tensor(W1))
            self.net[0].bias.copy_(torch.tensor(B1))
            self.net[-1].weight.copy_(torch.tensor(W2))
            self.net[-1].bias.copy_(torch.tensor(B2))

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Hidden(Node):
    """The first half, with its ReLU called as a function: no ReLU module anywhere."""

    def __init__(self):
        self.linear = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor(W1))
            self.linear.bias.copy_(torch.tensor(B1))

    def forward(self, x, ctx):
        return Opaque(F.relu(self.linear(x)))


class Out(Node):
    def __init__(self):
        self.linear = torch.nn.Linear(3, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor(W2))
            self.linear.bias.copy_(torch.tensor(B2))

    def forward(self, x, ctx):
        return Opaque(self.linear(x))


def tiny(norm=False):
    return Graph.somatize(Tiny(norm).named("tiny"))


def _exact(values):
    """The float32 numbers the network holds, in float64 for the arithmetic."""
    return torch.tensor(values, dtype=torch.float32).double()


def hand():
    """The forward pass, written out: pre-activations, the mask, hidden, output."""
    w1, b1, w2, b2, x = (_exact(v) for v in (W1, B1, W2, B2, X))
    pre = x @ w1.T + b1
    mask = (pre > 0).double()
    hidden = pre * mask
    out = hidden @ w2.T + b2
    return w1, w2, x, pre, mask, hidden, out


def hand_gradients():
    """dL/dW for L = mean squared error over the 3×2 outputs, by the chain rule."""
    w1, w2, x, _, mask, hidden, out = hand()
    r = 2 * (out - _exact(Y)) / out.numel()  # dL/d(out)
    g2 = r.T @ hidden
    g1 = ((r @ w2) * mask).T @ x
    return w1, w2, x, mask, hidden, r, g1, g2


def x_batch():
    return torch.tensor(X)


def loss_args():
    return {"target": torch.tensor(Y), "objective": F.mse_loss}


# -- each proxy against its formula ----------------------------------------------------
def test_synflow_is_the_flow_through_absolute_weights_from_an_input_of_ones():
    w1, w2, b1 = (_exact(v).abs() for v in (W1, W2, B1))
    hidden = w1 @ torch.ones(4, dtype=torch.float64) + b1  # every unit on: all positive
    # R = sum_k (|W2| h + |b2|)_k; dR/dW2[k, i] = h_i; dR/dW1[i, j] = sum_k |W2|[k, i] * 1
    d_w2 = hidden.expand(2, 3)
    d_w1 = w2.sum(dim=0)[:, None].expand(3, 4)
    expected = math.log(float((w1 * d_w1).sum() + (w2 * d_w2).sum()))
    assert proxy(tiny(), x_batch(), "synflow") == pytest.approx(expected, rel=1e-12)


def test_synflow_bypasses_batch_norm_as_the_reference_does():
    assert proxy(tiny(norm=True), x_batch(), "synflow") == pytest.approx(
        proxy(tiny(), x_batch(), "synflow"), rel=1e-12)


def test_jacob_cov_scores_the_correlation_of_the_input_jacobians():
    w1, w2, _, _, mask, _, _ = hand()
    # d(sum of example n's outputs)/d(x_n) = (mask_n ⊙ (W2ᵀ·1)) W1
    jacobians = (mask * w2.sum(dim=0)) @ w1
    centred = jacobians - jacobians.mean(dim=1, keepdim=True)
    unit = centred / centred.norm(dim=1, keepdim=True)
    shifted = unit @ unit.T + K * torch.eye(3, dtype=torch.float64)
    # Σ log(λ+k) = log det(C + kI) and Σ 1/(λ+k) = trace((C + kI)⁻¹)
    expected = -(torch.logdet(shifted) + torch.trace(torch.inverse(shifted)))
    assert proxy(tiny(), x_batch(), "jacob_cov") == pytest.approx(float(expected), rel=1e-5)


def _agreements(codes):
    rows = len(codes)
    return [[sum(1.0 for a, b in zip(codes[i], codes[j]) if a == b) for j in range(rows)]
            for i in range(rows)]


def _det3(m):
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def test_nwot_is_the_log_determinant_of_the_agreement_of_relu_codes():
    *_, mask, _, _ = hand()
    codes = mask.tolist()
    assert codes == [[1, 0, 1], [0, 1, 0], [1, 0, 0]]  # the batch was chosen for this
    expected = math.log(_det3(_agreements(codes)))  # [[3,0,2],[0,3,1],[2,1,3]]: det 12
    assert expected == pytest.approx(math.log(12))
    assert proxy(tiny(), x_batch(), "nwot") == pytest.approx(expected, rel=1e-12)


def test_nwot_without_relu_modules_reads_the_codes_off_every_nodes_output():
    *_, mask, _, out = hand()
    codes = [m + o for m, o in zip(mask.tolist(), (out > 0).double().tolist())]
    g = Graph.somatize(Hidden().named("hidden") >> Out().named("out"))
    # a 3×3 kernel from 5 units: 3 from the hidden node, 2 from the output node
    assert proxy(g, x_batch(), "nwot") == pytest.approx(math.log(_det3(_agreements(codes))), rel=1e-12)


def test_params_is_the_log_of_the_parameter_count():
    assert proxy(tiny(), x_batch(), "params") == pytest.approx(math.log(4 * 3 + 3 + 3 * 2 + 2))


def test_snip_sums_the_weight_times_gradient_magnitudes():
    w1, w2, *_, g1, g2 = hand_gradients()
    expected = math.log(float((w1 * g1).abs().sum() + (w2 * g2).abs().sum()))
    assert proxy(tiny(), x_batch(), "snip", **loss_args()) == pytest.approx(expected, rel=1e-5)


def test_grad_norm_adds_the_norm_of_each_layers_weight_gradient():
    *_, g1, g2 = hand_gradients()
    expected = math.log(float(g1.norm() + g2.norm()))
    assert proxy(tiny(), x_batch(), "grad_norm", **loss_args()) == pytest.approx(expected, rel=1e-5)


def test_grasp_is_minus_theta_times_the_hessian_gradient_product():
    w1, w2, x, mask, hidden, r, g1, g2 = hand_gradients()
    # The Hessian of the loss along v = g, by differentiating the gradient along v:
    # d(hidden) = mask ⊙ (x v1ᵀ), d(out) = hidden v2ᵀ + d(hidden) W2ᵀ, d(r) = 2 d(out) / 6.
    d_hidden = mask * (x @ g1.T)
    d_r = 2 * (hidden @ g2.T + d_hidden @ w2.T) / 6
    hg2 = d_r.T @ hidden + r.T @ d_hidden
    hg1 = ((d_r @ w2 + r @ g2) * mask).T @ x
    expected = float(-(w1 * hg1).sum() - (w2 * hg2).sum())
    assert proxy(tiny(), x_batch(), "grasp", **loss_args()) == pytest.approx(expected, rel=1e-4)


# -- what they leave, and what they refuse ----------------------------------------------
class Noisy(Node):
    """Batch norm (moving statistics), dropout (the random stream), a frozen half."""

    def __init__(self):
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                       torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))

    def forward(self, x, ctx):
        return Opaque(self.net(x))


def _state(g):
    net = g.implementation("noisy").net
    return ({k: v.clone() for k, v in net.state_dict().items()},
            {n: (None if p.grad is None else p.grad.clone()) for n, p in net.named_parameters()},
            {n: p.requires_grad for n, p in net.named_parameters()})


@pytest.mark.parametrize("name", EVERY)
def test_the_graph_is_exactly_as_it_was_after_every_proxy(name):
    torch.manual_seed(0)
    g = Graph.somatize(Noisy().named("noisy"))
    net = g.implementation("noisy").net
    net[0].weight.grad = torch.full_like(net[0].weight, 0.25)  # a gradient someone left
    net[4].weight.requires_grad_(False)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    weights, grads, flags = _state(g)
    stream = torch.get_rng_state()
    proxy(g, x, name, target=y, objective=F.cross_entropy)
    after_weights, after_grads, after_flags = _state(g)
    assert all(torch.equal(weights[k], after_weights[k]) for k in weights)
    assert all((grads[k] is None and after_grads[k] is None) or torch.equal(grads[k], after_grads[k])
               for k in grads)
    assert flags == after_flags and torch.equal(stream, torch.get_rng_state())


def test_proxies_answers_the_same_as_each_proxy_alone():
    torch.manual_seed(1)
    g = Graph.somatize(Noisy().named("noisy"))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    every = proxies(g, x, target=y, objective=F.cross_entropy)
    assert list(every) == list(EVERY)
    for name in EVERY:
        alone = proxy(g, x, name, target=y, objective=F.cross_entropy)
        assert alone == every[name] or (math.isnan(alone) and math.isnan(every[name]))


def test_the_proxies_that_read_a_loss_are_absent_without_one():
    assert list(proxies(tiny(), x_batch())) == ["synflow", "jacob_cov", "nwot", "params"]
    assert list(proxies(tiny(), Opaque(x_batch()), **loss_args())) == list(EVERY)


def test_an_unknown_proxy_is_refused_naming_every_one():
    with pytest.raises(ValueError) as refused:
        proxy(tiny(), x_batch(), "zen_nas")
    assert "'zen_nas'" in str(refused.value)
    assert all(repr(name) in str(refused.value) for name in EVERY)


def test_a_loss_proxy_without_a_loss_is_refused():
    with pytest.raises(TypeError, match="'snip' reads a loss.*target= and objective="):
        proxy(tiny(), x_batch(), "snip")
    with pytest.raises(TypeError, match="objective= is missing"):
        proxies(tiny(), x_batch(), target=torch.tensor(Y))
    with pytest.raises(TypeError, match="cannot be called"):
        proxies(tiny(), x_batch(), target=torch.tensor(Y), objective="mse")


def test_a_batch_that_is_not_a_tensor_is_refused():
    with pytest.raises(TypeError, match="a tensor whose first dimension counts the examples"):
        proxies(tiny(), [[1.0, 2.0, 3.0, 4.0]])


class Tokens(Node):
    def __init__(self):
        self.embed = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, tokens, ctx):
        return Opaque(self.out(torch.relu(self.embed(tokens)).mean(dim=1)))


def test_token_ids_have_no_jacobian_so_jacob_cov_is_left_out_and_refused_alone():
    torch.manual_seed(0)
    g = Graph.somatize(Tokens())
    tokens = torch.randint(0, 10, (5, 7))
    assert "jacob_cov" not in proxies(g, tokens)
    assert {"synflow", "nwot", "params"} <= set(proxies(g, tokens))
    with pytest.raises(ValueError, match="'jacob_cov' cannot be taken here: .*torch.int64"):
        proxy(g, tokens, "jacob_cov")


def test_a_graph_that_answers_no_tensor_is_refused_clearly():
    class Talk(Node):
        def __init__(self):
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x, ctx):
            return f"{self.linear(x).shape[0]} rows"

    with pytest.raises(TypeError, match="produced a str"):
        proxy(Graph.somatize(Talk()), x_batch(), "synflow")


# -- the search-space evaluation, small ---------------------------------------------------
def test_the_search_space_evaluation_runs_end_to_end(benchmark_file):
    pytest.importorskip("sklearn")
    bench = benchmark_file("proxies")
    rows = bench.evaluate(bench.quick_space(), epochs=1)
    assert [row["name"] for row in rows] == [c.name for c in bench.quick_space()]
    assert all(0.0 <= row["accuracy"] <= 1.0 and set(EVERY) <= set(row) for row in rows)
    assert len({row["accuracy"] for row in rows}) > 1  # they were really trained, differently
    found = bench.correlations(rows)
    assert set(found) == set(EVERY)
    assert all(-1.0 <= rho <= 1.0 and n >= 3 for rho, n in (found[k] for k in ("params", "synflow")))


def test_spearman_matches_its_definition_with_ties(benchmark_file):
    bench = benchmark_file("proxies")
    assert bench.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == (1.0, 4)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == (-1.0, 4)
    rho, n = bench.spearman([1, float("nan"), 3, float("-inf")], [1, 2, 3, 0])
    assert (rho, n) == (1.0, 3)  # NaN left out, -inf kept as the lowest
