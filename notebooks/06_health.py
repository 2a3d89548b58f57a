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
# # 06 — The health of a network, from its record
#
# Measurement and opinion are kept apart. `Trainer(..., auditing=True)` measures —
# what each node produced, the gradient that came back for it, how far the step moved
# its weights — and writes `health` facts into the record beside the loss. It never
# judges. `somatize.health` judges, from the stored record alone, with thresholds that
# are arguments: changing your mind about a threshold never costs a training run.
#
# Here a fault is seeded on purpose: a ReLU layer whose bias starts at −10, so almost
# every unit it has is dead from the first step.

# %%
import os
import subprocess
import sys
import tempfile

import torch

from somatize import Graph, Node, Opaque, Recorder, Store
from somatize.health import diagnose, history, overlay, seen
from somatize.torch import Trainer, parameters


class Dense(Node):
    def __init__(self, fan_in, fan_out):
        self.layer = torch.nn.Linear(fan_in, fan_out)

    def forward(self, x, ctx):
        return Opaque(torch.relu(self.layer(x)))

    def parameters(self):
        return list(self.layer.parameters())


class Out(Node):
    def __init__(self, fan_in, outputs=1):
        self.layer = torch.nn.Linear(fan_in, outputs)

    def forward(self, x, ctx):
        return Opaque(self.layer(x))

    def parameters(self):
        return list(self.layer.parameters())


torch.manual_seed(0)
g = Graph.somatize(Dense(8, 32).named("l1") >> Dense(32, 32).named("l2")
                   >> Dense(32, 32).named("l3") >> Out(32).named("out"))
with torch.no_grad():
    g.implementation("l2").layer.bias.fill_(-10.0)  # the fault

generator = torch.Generator().manual_seed(1)
teacher = torch.randn(8, 1, generator=generator)
batches = []
for _ in range(60):
    x = torch.randn(32, 8, generator=generator)
    batches.append((x, torch.tanh(x @ teacher)))

# %% [markdown]
# ## Train, recorded and audited

# %%
os.makedirs("runs", exist_ok=True)  # a fresh store per run, where you can serve it after
where = tempfile.mkdtemp(prefix="06-health-", dir="runs")
store = Store(where)
recorder = Recorder(store, run="seeded", summarising=["loss"])
trainer = Trainer(g, objective=torch.nn.functional.mse_loss,
                  optimizer=torch.optim.Adam(parameters(g), lr=1e-3),
                  watching=recorder, auditing=True)
result = trainer.fit(batches)
trainer.close()
recorder.close()
print(f"loss {result.history[0]:.3f} -> {result.loss:.3f}")

# %% [markdown]
# Nothing failed: no error, no NaN, a loss at every step. That is what makes this kind
# of fault expensive — a net that runs, and does not learn. The record says why:

# %%
at_the_end = seen(store, "seeded")
for where_, measures in at_the_end.items():
    print(f"{where_:4} zeros {measures.get('act_zero', float('nan')):.2f}   "
          f"grad_norm {measures.get('grad_norm', float('nan')):.2e}")

# %% [markdown]
# Each finding says where, what, since when, the numbers that made the rule say so —
# and what to do about it there:

# %%
for finding in diagnose(store, "seeded"):
    print(f"{finding.where} {finding.what} since step {finding.since}")
    print(f"    {finding.advice}")

# %% [markdown]
# ## The same diagnosis, from the store alone
#
# In another process, with no model and without torch at all: the record is enough.

# %%
code = f"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'torch':
            raise ImportError('torch is not needed to read a record')
sys.meta_path.insert(0, NoTorch())
from somatize import Store
from somatize.health import diagnose
for finding in diagnose(Store({where!r}), "seeded"):
    print(finding.where, finding.what, finding.since)
"""
elsewhere = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print(elsewhere.stdout or elsewhere.stderr)
here = [(f.where, f.what, f.since) for f in diagnose(store, "seeded")]
print("same findings:", [line.split() for line in elsewhere.stdout.splitlines()]
      == [[w, k, str(s)] for w, k, s in here])

# %% [markdown]
# ## The run's own symptoms
#
# Some faults live in no layer. Here the same kind of net learns three classes whose
# labels were shuffled: every layer is healthy, and the loss has nothing to learn. The
# run-level rules read the loss the Trainer recorded, against its own noise, and say
# so at `where="loss"`.

# %%
torch.manual_seed(0)
classifier = Graph.somatize(Dense(8, 32).named("l1") >> Dense(32, 32).named("l2")
                            >> Out(32, outputs=3).named("out"))
shuffled = [(x, torch.randint(0, 3, (32,), generator=generator)) for x, _ in batches]
recorder = Recorder(store, run="shuffled", summarising=["loss"])
trainer = Trainer(classifier, objective=torch.nn.functional.cross_entropy,
                  optimizer=torch.optim.Adam(parameters(classifier), lr=1e-2),
                  watching=recorder, auditing=True)
result = trainer.fit(shuffled)
trainer.close()
recorder.close()
print(f"loss {result.history[0]:.3f} -> {result.loss:.3f}")
for finding in diagnose(store, "shuffled"):
    print(f"{finding.where} {finding.what} since step {finding.since}")
    print(f"    {finding.advice}")

# %% [markdown]
# ## Drawn: the graph, with what was found laid over it

# %%
flags = overlay(diagnose(store, "seeded"))
print(flags)
figure = g.figure(overlay=flags)
figure.write_html(f"{where}/graph.html", include_plotlyjs=True)
len(history(store, "seeded")["l2"]["act_zero"])
