# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 — Many training runs: a federated round is a `for`
#
# The third level has no type of its own. Several training runs averaged together are
# a loop over Trainers and one function, `fedavg`. Across processes or machines the
# only thing they share is a store they can all reach — a folder or a bucket — and
# `gather` does a round through it: each client keeps its weights, whoever finds the
# round complete claims the averaging, and everybody gets the same average back. No
# coordinator, no port.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import somatize
from somatize import Graph, Node, Opaque, Store
from somatize.torch import Trainer, fedavg, parameters

torch.manual_seed(0)


class Linear(Node):
    def __init__(self):
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, ctx):
        return Opaque(self.lin(x))

    def parameters(self):
        return list(self.lin.parameters())


truth = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def shard(seed, rows):
    """Each client's own data: the same law, different samples, different sizes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=generator)
    return [(x[i:i + 16], x[i:i + 16] @ truth) for i in range(0, rows, 16)]


shards = [shard(seed, rows) for seed, rows in enumerate([64, 128, 32])]
sizes = [sum(len(x) for x, _ in data) for data in shards]

# %% [markdown]
# ## Rounds as a `for`, in one process
#
# Three clients, each a graph and a Trainer. Every round: load the average, train on
# the shard, export. `fedavg` weighs each export by how much data it saw.

# %%
clients = []
for _ in shards:
    torch.manual_seed(0)  # every client starts from the same weights
    g = Graph.somatize(Linear().named("model"))
    clients.append(Trainer(g, objective=torch.nn.functional.mse_loss,
                           optimizer=torch.optim.SGD(parameters(g), lr=0.05)))

average = clients[0].export()
for round_ in range(5):
    exports = []
    for trainer, data in zip(clients, shards):
        trainer.load(average)
        trainer.fit(data)
        exports.append(trainer.export())
    average = fedavg(exports, sizes=sizes)
    learnt = average["model"]["lin.weight"].flatten().tolist()
    print(f"round {round_}: weights {[round(w, 2) for w in learnt]}")

# %% [markdown]
# The weights walk toward the law the data follows, `[1, -2, 0.5, 3]`, though no
# client ever saw another's data.
#
# ## The same rounds across processes
#
# `examples/federated.py` is the same idea as separate processes: each client trains
# on its shard and calls `gather(store, export, run=..., round=..., clients=..., mine=...)`
# every round. Here four clients run as four processes sharing one folder.

# %%
os.makedirs("runs", exist_ok=True)  # a fresh store per run, where you can serve it after
where = tempfile.mkdtemp(prefix="04-federated-", dir="runs")
# the clone make installed from (src/somatize/__init__.py), wherever this kernel runs
example = os.path.join(Path(somatize.__file__).resolve().parents[2], "examples", "federated.py")
done = subprocess.run([sys.executable, example, "--store", where, "--clients", "4",
                       "--rounds", "3", "--steps", "4", "--asking", "0.05", "--run", "nb"],
                      capture_output=True, text=True, timeout=300)
print(done.stdout[-600:])
assert done.returncode == 0, done.stderr

# %% [markdown]
# What the round left behind is in the folder: each client's part, who claimed the
# averaging, and the average every client returned.

# %%
store = Store(where)
for bound in store.bound("fed/nb/2"):
    print(f"{bound.name:32} {dict(bound.meta)}")
