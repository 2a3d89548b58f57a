"""What a network is made of: architecture, traced, kind_of, on models written here.

A ResNet-like graph (a stem node, a node of residual blocks of which three are the
same, a head node) and a transformer-like one (an embedding node, a node of six
identical blocks, a head node), both without torchvision.
"""

import pytest
import torch

from somatize import Graph, Node, Opaque
from somatize.torch._architecture import LAYER_KINDS, architecture, kind_of, traced

nn, F = torch.nn, torch.nn.functional


# -- a ResNet-like graph ------------------------------------------------------------------
class Residual(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Stem(Node):
    def __init__(self):
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x, ctx):
        return Opaque(self.stem(x))


class Stages(Node):
    def __init__(self):
        self.blocks = nn.Sequential(Residual(8, 8), Residual(8, 8), Residual(8, 8),
                                    Residual(8, 16, stride=2), Residual(16, 16))

    def forward(self, x, ctx):
        return Opaque(self.blocks(x))


class Pooled(Node):
    def __init__(self):
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x, ctx):
        return Opaque(self.fc(torch.flatten(self.pool(x), 1)))


def resnet():
    torch.manual_seed(0)
    return Graph.somatize(Stem().named("stem") >> Stages().named("body") >> Pooled().named("head"))


def images():
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def entries(inside):
    return [(path, what["kind"], what["cls"], what["times"]) for path, what in inside]


def held_parameters(graph, node_id):
    node = graph.implementation(node_id)
    return sum(p.numel() for m in vars(node).values() if isinstance(m, nn.Module) for p in m.parameters())


def test_resnet_at_depth_0_lists_what_each_node_holds_with_identical_blocks_folded():
    g = resnet()
    inside = architecture(g, images())
    assert entries(inside["stem"]) == [("stem.0", "conv", "Conv2d", 1), ("stem.1", "normalisation", "BatchNorm2d", 1),
                                       ("stem.2", "activation", "ReLU", 1)]
    assert entries(inside["body"]) == [("blocks.0", "block", "Residual", 3), ("blocks.3", "block", "Residual", 1),
                                       ("blocks.4", "block", "Residual", 1)]
    assert entries(inside["head"]) == [("pool", "pooling", "AdaptiveAvgPool2d", 1), ("fc", "linear", "Linear", 1)]
    body = dict(inside["body"])
    assert body["blocks.0"]["paths"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert (body["blocks.0"]["shape_in"], body["blocks.0"]["shape_out"]) == ([2, 8, 8, 8], [2, 8, 8, 8])
    assert (body["blocks.3"]["shape_in"], body["blocks.3"]["shape_out"]) == ([2, 8, 8, 8], [2, 16, 4, 4])
    assert body["blocks.0"]["params"] == sum(p.numel() for p in Residual(8, 8).parameters())
    assert all(what["via"] == "hooks" for listed in inside.values() for _, what in listed)


def test_a_node_in_the_middle_is_traced_on_what_its_predecessor_produced():
    inside = architecture(resnet(), images())
    head = dict(inside["head"])
    # the graph's input is 2×3×8×8; the head is handed the body's 2×16×4×4
    assert head["pool"]["shape_in"] == [2, 16, 4, 4] and head["pool"]["shape_out"] == [2, 16, 1, 1]
    assert head["fc"]["shape_in"] == [2, 16] and head["fc"]["shape_out"] == [2, 10]


def test_params_times_copies_add_up_to_what_each_node_holds_at_every_depth():
    g = resnet()
    for depth in (0, 1, 2):
        inside = architecture(g, images(), depth=depth)
        for node_id, listed in inside.items():
            assert sum(w["params"] * w["times"] for _, w in listed) == held_parameters(g, node_id)


def test_depth_1_opens_the_blocks_through_fx_functional_relus_included():
    body = architecture(resnet(), images(), depth=1)["body"]
    first = [(p, k, c, t) for p, k, c, t in entries(body) if p.startswith("blocks.0.")]
    assert first == [
        ("blocks.0.conv1", "conv", "Conv2d", 3), ("blocks.0.bn1", "normalisation", "BatchNorm2d", 3),
        ("blocks.0.relu()", "activation", "relu", 3), ("blocks.0.conv2", "conv", "Conv2d", 3),
        ("blocks.0.bn2", "normalisation", "BatchNorm2d", 3), ("blocks.0.shortcut", "other", "Identity", 3),
        ("blocks.0.relu_1()", "activation", "relu", 3)]
    opened = dict(body)
    assert opened["blocks.0.conv1"]["paths"] == ["blocks.0.conv1", "blocks.1.conv1", "blocks.2.conv1"]
    assert all(w["via"] == "fx" for _, w in body)
    assert [w["within"] for _, w in body] == ["blocks.0"] * 7 + ["blocks.3"] * 8 + ["blocks.4"] * 7
    # the downsampling block: its shortcut Sequential is seen through, shapes from fx
    assert opened["blocks.3.shortcut.0"]["shape_out"] == [2, 16, 4, 4]
    assert opened["blocks.3.conv1"]["shape_in"] == [2, 8, 8, 8]
    assert opened["blocks.3.relu_1()"]["shape_in"] == [2, 16, 4, 4]


def test_architecture_leaves_weights_buffers_and_the_random_stream_as_they_were():
    g = resnet()
    nets = [vars(g.implementation(n)) for n in g.nodes()]
    before = [{k: v.clone() for m in net.values() if isinstance(m, nn.Module)
               for k, v in m.state_dict().items()} for net in nets]
    stream = torch.get_rng_state()
    x = images()
    architecture(g, x, depth=2)  # batch norms in training mode would move their statistics
    after = [{k: v for m in net.values() if isinstance(m, nn.Module)
              for k, v in m.state_dict().items()} for net in nets]
    assert all(torch.equal(b[k], a[k]) for b, a in zip(before, after) for k in b)
    assert torch.equal(stream, torch.get_rng_state())
    assert all(p.grad is None for n in g.nodes() for m in vars(g.implementation(n)).values()
               if isinstance(m, nn.Module) for p in m.parameters())


def test_without_an_example_the_parts_are_listed_as_declared_without_shapes():
    inside = architecture(resnet())
    assert entries(inside["body"]) == [("blocks.0", "block", "Residual", 3), ("blocks.3", "block", "Residual", 1),
                                       ("blocks.4", "block", "Residual", 1)]
    assert all(w["shape_in"] is None and w["via"] == "declared" for _, w in inside["body"])


# -- a transformer-like graph ---------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm1 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, width))
        self.norm2 = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = self.norm1(x + self.drop(self.attn(x, x, x, need_weights=False)[0]))
        return self.norm2(x + self.drop(self.ff(x)))


class Embed(Node):
    def __init__(self):
        self.tokens = nn.Embedding(50, 16)
        self.position = nn.Parameter(torch.zeros(1, 7, 16))

    def forward(self, ids, ctx):
        return Opaque(self.tokens(ids) + self.position)


class Encoder(Node):
    def __init__(self, block=Block):
        self.blocks = nn.ModuleList(block() for _ in range(6))

    def forward(self, x, ctx):
        for block in self.blocks:
            x = block(x)
        return Opaque(x)


class Classify(Node):
    def __init__(self):
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, ctx):
        return Opaque(self.out(self.norm(x).mean(dim=1)))


def transformer(block=Block):
    torch.manual_seed(0)
    return Graph.somatize(Embed().named("embed") >> Encoder(block).named("encoder") >> Classify().named("head"))


def token_ids():
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))


def test_six_identical_transformer_blocks_read_as_one_entry_times_six():
    inside = architecture(transformer(), token_ids())
    assert entries(inside["embed"]) == [("tokens", "embedding", "Embedding", 1),
                                        ("position", "parameter", "Parameter", 1)]
    assert entries(inside["encoder"]) == [("blocks.0", "block", "Block", 6)]
    block = dict(inside["encoder"])["blocks.0"]
    # handed the embedding's 3×7×16, not the graph's 3×7 token ids
    assert block["shape_in"] == [3, 7, 16] and block["shape_out"] == [3, 7, 16]
    assert block["paths"] == [f"blocks.{i}" for i in range(6)]
    assert block["params"] == sum(p.numel() for p in Block().parameters())


def test_depth_1_opens_a_transformer_block_and_depth_2_opens_its_attention():
    g = transformer()
    one = architecture(g, token_ids(), depth=1)["encoder"]
    assert entries(one) == [
        ("blocks.0.attn", "attention", "MultiheadAttention", 6), ("blocks.0.drop", "dropout", "Dropout", 6),
        ("blocks.0.norm1", "normalisation", "LayerNorm", 6), ("blocks.0.ff.0", "linear", "Linear", 6),
        ("blocks.0.ff.1", "activation", "GELU", 6), ("blocks.0.ff.2", "linear", "Linear", 6),
        ("blocks.0.norm2", "normalisation", "LayerNorm", 6)]
    assert dict(one)["blocks.0.ff.0"]["shape_out"] == [3, 7, 32]
    assert {w["within"] for _, w in one} == {"blocks.0"}
    two = architecture(g, token_ids(), depth=2)["encoder"]
    assert entries(two)[:3] == [("blocks.0.attn.in_proj_weight", "parameter", "Parameter", 6),
                                ("blocks.0.attn.in_proj_bias", "parameter", "Parameter", 6),
                                ("blocks.0.attn.out_proj", "linear", "NonDynamicallyQuantizableLinear", 6)]
    assert sum(w["params"] * w["times"] for _, w in two) == 6 * sum(p.numel() for p in Block().parameters())
    assert [w["within"] for _, w in two[:4]] == ["blocks.0.attn"] * 3 + ["blocks.0"]


def test_torch_transformer_layers_are_one_box_and_open_through_the_hooks():
    g = transformer(lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))
    assert entries(architecture(g, token_ids())["encoder"]) == [
        ("blocks.0", "block", "TransformerEncoderLayer", 6)]
    opened = architecture(g, token_ids(), depth=1)["encoder"]
    assert entries(opened)[0] == ("blocks.0.self_attn", "attention", "MultiheadAttention", 6)
    assert {w["via"] for _, w in opened} == {"hooks"}  # fx cannot trace torch's layer
    assert dict(opened)["blocks.0.linear1"]["shape_out"] == [3, 7, 32]


def test_most_caps_the_entries_and_says_what_was_left_out():
    g = transformer()
    full = architecture(g, token_ids(), depth=1)["encoder"]
    capped = architecture(g, token_ids(), depth=1, most=3)["encoder"]
    assert capped[:2] == full[:2] and len(capped) == 3
    path, rest = capped[2]
    assert path == "…" and rest["kind"] == "other" and rest["cls"] == f"{len(full) - 2} more"
    assert rest["params"] == sum(w["params"] * w["times"] for _, w in full[2:])
    assert rest["paths"] == [p for _, w in full[2:] for p in w["paths"]]


# -- what fx cannot trace, fan-in, refusals -------------------------------------------------
class Gate(nn.Module):
    """Control flow on a value: fx cannot trace it; only a real forward can say."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.up(x)
        return self.down(x)


class Gated(Node):
    def __init__(self):
        self.gate = Gate()

    def forward(self, x, ctx):
        return Opaque(self.gate(x))


def test_a_module_fx_cannot_trace_still_gets_its_shapes_from_the_hooks():
    g = Graph.somatize(Gated())
    x = torch.ones(5, 4)
    opened = dict(architecture(g, x, depth=1)["gated"])
    assert opened["gate.up"]["via"] == "hooks"
    assert (opened["gate.up"]["shape_in"], opened["gate.up"]["shape_out"]) == ([5, 4], [5, 6])
    assert opened["gate.down"]["shape_in"] is None  # never called on this example
    assert traced(Gate()) is None  # no example, and fx cannot trace it
    listed = dict(traced(Gate(), -x))
    assert listed["down"]["shape_out"] == [5, 2] and listed["up"]["shape_out"] is None
    assert [p for p, _ in traced(Gate(), -x)] == ["down", "up"]  # the one called comes first


def test_traced_answers_by_fx_where_it_can_with_and_without_an_example():
    symbolic = traced(Residual(4, 4))
    assert [(p, w["kind"]) for p, w in symbolic] == [
        ("conv1", "conv"), ("bn1", "normalisation"), ("relu()", "activation"), ("conv2", "conv"),
        ("bn2", "normalisation"), ("shortcut", "other"), ("relu_1()", "activation")]
    assert all(w["via"] == "fx" and w["shape_in"] is None for _, w in symbolic)
    shaped = dict(traced(Residual(4, 8, stride=2), torch.randn(1, 4, 6, 6)))
    assert shaped["conv1"]["shape_out"] == [1, 8, 3, 3] and shaped["shortcut.0"]["shape_in"] == [1, 4, 6, 6]
    with pytest.raises(TypeError, match="traced\\(\\) takes a torch.nn.Module"):
        traced(Stem())
    with pytest.raises(RuntimeError, match="channels"):  # the example's fault, said as such
        traced(Residual(4, 4), torch.randn(1, 3, 6, 6))


class Join(Node):
    def __init__(self):
        self.mix = nn.Linear(8 + 3, 2)

    def forward(self, inputs, ctx):
        return Opaque(self.mix(torch.cat([inputs["left"], inputs["right"]], dim=1)))


class Width(Node):
    def __init__(self, width):
        self.linear = nn.Linear(4, width)

    def forward(self, x, ctx):
        return Opaque(self.linear(x))


def test_a_fan_in_is_traced_on_what_both_predecessors_produced():
    g = Graph.somatize((Width(8).named("left") | Width(3).named("right")) >> Join().named("join"))
    inside = architecture(g, torch.randn(5, 4))
    assert dict(inside["join"])["mix"]["shape_in"] == [5, 11]
    assert dict(inside["right"])["linear"]["shape_out"] == [5, 3]


def test_nodes_holding_nothing_are_left_out_and_bad_arguments_refused():
    class Plain(Node):
        def forward(self, x, ctx):
            return Opaque(x)

    g = Graph.somatize(Plain().named("plain") >> Gated().named("gated"))
    assert list(architecture(g, Opaque(torch.ones(2, 4)))) == ["gated"]
    with pytest.raises(ValueError, match="most=0; most is a whole number from 1 up"):
        architecture(g, most=0)
    with pytest.raises(TypeError, match="depth=1.5; depth is a whole number"):
        architecture(g, depth=1.5)


def test_a_failing_run_raises_and_leaves_no_hooks_behind():
    g = resnet()
    with pytest.raises(Exception, match="stem"):
        architecture(g, torch.randn(2, 5, 8, 8))  # five channels where three are expected
    stem = g.implementation("stem").stem
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in stem.modules())


def test_the_figure_draws_six_blocks_as_one_box_times_six():
    pytest.importorskip("plotly")
    g = transformer()
    figure = g.figure(inside=architecture(g, token_ids()))
    text = " ".join(str(getattr(trace, "text", "") or "") for trace in figure.data)
    text += " ".join(str(a.text) for a in figure.layout.annotations)
    assert "×6" in text


# -- kind_of ------------------------------------------------------------------------------------
def test_kind_of_knows_torchs_classes_by_role():
    assert kind_of(nn.Linear(2, 2)) == "linear" and kind_of(nn.Conv1d(1, 1, 1)) == "conv"
    assert kind_of(nn.ConvTranspose2d(1, 1, 1)) == "conv" and kind_of(nn.GroupNorm(1, 2)) == "normalisation"
    assert kind_of(nn.Softmax(dim=1)) == "activation" and kind_of(nn.Hardshrink()) == "activation"
    assert kind_of(nn.MultiheadAttention(4, 1)) == "attention" and kind_of(nn.LSTM(2, 2)) == "recurrent"
    assert kind_of(nn.EmbeddingBag(3, 2)) == "embedding" and kind_of(nn.AlphaDropout()) == "dropout"
    assert kind_of(nn.LPPool2d(2, 2)) == "pooling" and kind_of(nn.LocalResponseNorm(2)) == "normalisation"
    assert kind_of(nn.TransformerEncoderLayer(4, 1)) == "block" and kind_of(nn.Flatten()) == "other"
    assert kind_of(nn.Parameter(torch.zeros(1))) == "parameter"


def test_kind_of_guesses_classes_it_has_never_seen_by_their_names():
    def module(name, children=False):
        def init(self):
            nn.Module.__init__(self)
            if children:
                self.inner = nn.Linear(1, 1)
        return type(name, (nn.Module,), {"__init__": init})()

    said = {name: kind_of(module(name)) for name in (
        "RMSNorm2d", "MyNorm", "DepthwiseConv", "ConvBNReLU", "CrossAttention", "GlobalPool",
        "AttentionPooling", "TokenEmbedding", "DropPath", "Swish", "QuickGELU", "MinGRU", "Dense")}
    assert said == {"RMSNorm2d": "normalisation", "MyNorm": "normalisation", "DepthwiseConv": "conv",
                    "ConvBNReLU": "conv", "CrossAttention": "attention", "GlobalPool": "pooling",
                    "AttentionPooling": "pooling", "TokenEmbedding": "embedding", "DropPath": "dropout",
                    "Swish": "activation", "QuickGELU": "activation", "MinGRU": "recurrent",
                    "Dense": "linear"}
    assert kind_of(module("Mixer", children=True)) == "block" and kind_of(module("Scale")) == "other"
    assert kind_of(type("Wide", (nn.Linear,), {})(2, 2)) == "linear"  # inherited along the MRO
    assert kind_of(nn.BatchNorm2d) == "normalisation" and kind_of("InstanceNorm3d") == "normalisation"


def test_kind_of_reads_functions_by_name_and_refuses_what_it_cannot_read():
    assert [kind_of(f) for f in (F.relu, torch.tanh, F.max_pool2d, F.layer_norm, F.dropout,
                                 F.conv2d, F.scaled_dot_product_attention, F.embedding, F.linear)] == [
        "activation", "activation", "pooling", "normalisation", "dropout", "conv", "attention",
        "embedding", "linear"]
    assert kind_of(torch.add) == "other" and kind_of("gelu") == "activation"
    assert set(LAYER_KINDS) >= {"linear", "conv", "normalisation", "activation", "attention", "embedding",
                          "dropout", "pooling", "recurrent", "other"}
    with pytest.raises(TypeError, match="not a int"):
        kind_of(3)
