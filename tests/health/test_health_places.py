"""Where a finding is, from a real audited run whose node ids hold dots, spaces and
letters beyond ASCII: each finding names its node and the path inside it, the report
draws the graph with them, and the advice names the node as it is."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("plotly")

import somatize  # noqa: E402
from somatize import Graph, Node, Opaque  # noqa: E402
from somatize.health import diagnose, overlay  # noqa: E402
from somatize.record import Recorder  # noqa: E402
from somatize.store import Store  # noqa: E402
from somatize.torch import Audit, Trainer, parameters  # noqa: E402


class Dense(Node):
    def __init__(self, fan_in, fan_out, bias=None):
        self.layer = torch.nn.Linear(fan_in, fan_out)
        if bias is not None:
            with torch.no_grad():
                self.layer.bias.fill_(bias)

    def forward(self, x, ctx):
        return Opaque(torch.relu(self.layer(x)))

    def parameters(self):
        return list(self.layer.parameters())


class Out(Node):
    def __init__(self, fan_in):
        self.layer = torch.nn.Linear(fan_in, 1)

    def forward(self, x, ctx):
        return Opaque(self.layer(x))

    def parameters(self):
        return list(self.layer.parameters())


def test_dotted_node_ids_are_one_node_each_from_audit_to_report(tmp_path):
    torch.manual_seed(0)
    g = Graph.somatize(Dense(8, 16, bias=-10.0).named("enc.v2") >> Dense(16, 16).named("layer.1")
                       >> Out(16).named("héad ü"))
    store = Store(tmp_path / "s", durable=False)
    recorder = Recorder(store, run="dots", summarising=["loss"])
    trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                      optimizer=torch.optim.SGD(parameters(g), lr=0.05), watching=[recorder],
                      auditing=Audit(inside={"enc.v2": ["layer"]}))
    x = torch.randn(16, 8)
    for _ in range(25):
        trainer.step((x, x.sum(1, keepdim=True)))
    trainer.close()
    recorder.close()
    found = diagnose(store, "dots")
    places = {(f.where, f.node, f.path) for f in found}
    assert ("enc.v2", "enc.v2", "") in places and ("enc.v2.layer", "enc.v2", "layer") in places
    assert set(overlay(found)) <= {"enc.v2", "layer.1", "héad ü"}
    assert "enc.v2" in overlay(found)
    dead = next(f for f in found if f.where == "enc.v2" and f.what == "dying")
    assert dead.advice.startswith("Most of what enc.v2 produces is exactly 0")
    done = subprocess.run([sys.executable, "-m", "somatize", "report", store.where, "dots",
                           "-o", str(tmp_path / "dots.html")], capture_output=True, text=True,
                          timeout=120, check=False, env={
                              **os.environ, "PYTHONPATH": os.path.dirname(
                                  os.path.dirname(somatize.__file__))})
    assert done.returncode == 0, done.stderr
    assert "could not be drawn" not in (tmp_path / "dots.html").read_text()
