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
# # 03 — Training
#
# A graph does not train itself, and has no `fit`. Something outside it — a `Trainer` —
# takes the graph and moves its weights, which means one graph can be trained in several
# different ways while staying exactly the graph it was, and no node ever has to know
# whether this forward is a training one.
#
# Each level below is unaware of the one above it:
#
# | level | how big |
# |---|---|
# | the graph | a single `forward` |
# | the `Trainer` | one training run: an afternoon |
# | many training runs | a plain Python `for` (notebook 4) |

# %%
import os
import tempfile

import torch

import somatize.torch  # registers the codec that lets a tensor cross an edge
from somatize import Graph, Node, Opaque, Recorder, Store
from somatize.record import Live, curve, forwards, nodes, progress, spent
from somatize.torch import Trainer, freeze, parameters

torch.manual_seed(0)

# %% [markdown]
# ## Holding weights does not make a node special
#
# These nodes answer with an `Opaque`: the tensor inside still has its autograd graph,
# and that graph only exists in this process. Turned into plain data it would lose it,
# and the backward pass would have nothing to walk back through.
#
# The wrapper is about the edge, not the node: the node below receives the tensor
# itself, already unwrapped.

# %%
class Body(Node):
    def __init__(self, width=32):
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )

    def forward(self, x, ctx):
        return Opaque(self.net(x))

    def parameters(self):
        return list(self.net.parameters())


class Head(Node):
    def __init__(self, width=32):
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x, ctx):
        # `x` is a tensor, not an `Opaque`: what the node above wrapped is
        # unwrapped on the way in. The wrapper is about **crossing**, not about
        # what a node holds.
        return Opaque(self.out(x))

    def parameters(self):
        return list(self.out.parameters())


def built(width=32, lr=1e-2):
    g = Graph.somatize(Body(width).named("body") >> Head(width).named("head"))
    return g, torch.optim.Adam(parameters(g), lr=lr)

# %% [markdown]
# ## Invented data
#
# A linear map plus a little noise: the loss has a floor to fall towards, and there is
# nothing to download.

# %%
truth = torch.randn(8, 1)


def batch(how_many=64):
    x = torch.randn(how_many, 8)
    return x, x @ truth + 0.1 * torch.randn(how_many, 1)

# %% [markdown]
# ## `step` is the primitive; `fit` is a loop around it
#
# A step runs the graph forward, takes the loss, runs it backward, and updates the
# weights when its group is complete. Anything an epoch loop cannot express is a
# `while` over `step`.

# %%
g, optimizer = built()
os.makedirs("runs", exist_ok=True)  # a fresh store per run, where you can serve it after
store = Store(tempfile.mkdtemp(prefix="03-training-", dir="runs"))
live = Live(title="training")
recorder = Recorder(store, run="a-run", summarising=["loss"])

trainer = Trainer(
    g,
    objective=torch.nn.functional.mse_loss,
    optimizer=optimizer,
    watching=[recorder, live],
)

for _ in range(300):
    trainer.step(batch())

live

# %% [markdown]
# One stream, two vocabularies: the engine says which node ran and for how long, and
# the trainer adds `loss` and `updated`. The engine could not have said the loss — it
# is the trainer's arithmetic — and the two meet only in the record they are written to.

# %%
facts_of_a_step = __import__("somatize.record", fromlist=["facts"]).facts
facts_of_a_step(store, run="a-run", forward=10)

# %%
progress(store, run="a-run")

# %% [markdown]
# ## Where the time went
#
# Summed over the run, node by node. Two nodes hide nothing; twenty, with a hop to a
# device, is where a slow step is explained.

# %%
spent(store, run="a-run")

# %% [markdown]
# ## Several steps, one update
#
# `every=N` is for a batch too big to fit when its gradient is not: N steps accumulate,
# one update applies them, and each loss is divided by N on its way backward so the
# group moves the weights as one step over all N batches would. `micro=N` goes the
# other way — one step cut into N pieces — and the two multiply.

# %%
g, optimizer = built()
seen = []
grouped = Trainer(
    g,
    objective=torch.nn.functional.mse_loss,
    optimizer=optimizer,
    every=4,
    watching=seen.append,
)
for _ in range(8):
    grouped.step(batch())

said = [one["fact"] for one in seen]
print("losses :", said.count("loss"))
print("updates:", said.count("updated"), "— eight steps, two updates")

# %% [markdown]
# ## Frozen, and why a cache insists on it
#
# `.cached()` says an output is worth keeping; `.frozen()` says the node will not
# change, so what was kept is still what it would answer. Keeping the output of
# something that can still change is refused before any node runs, rather than found
# out later as a net that silently stopped learning.

# %%
frozen_g = Graph.somatize(Body().named("body").frozen().cached() >> Head().named("head"))
# Declaring it is the graph's half; making it true is torch's: freeze() notes the
# digest of its weights as the state it is frozen at, without which two checkpoints
# of different weights would share one name. (Fingerprints are something else: the
# code version a node may note. These note none.)
freeze(frozen_g)
print("frozen at:", {k: v[:16] + "…" for k, v in frozen_g.frozen().items()})
print("fingerprints:", {k: v[:16] + "…" for k, v in frozen_g.fingerprints().items()})

kept = tempfile.mkdtemp(prefix="03-frozen-", dir="runs")
said = lambda f: print(" ", f["fact"], f.get("node", ""))

# `Opaque` on the way in too: a bare tensor is refused at the edge, and the
# refusal names the two right answers rather than picking one.
same = Opaque(torch.randn(4, 8))
for which in ("first time", "same batch again"):
    print(which)
    frozen_g.forward(same, store=kept, watching=said)

print("a different batch")
frozen_g.forward(Opaque(torch.randn(4, 8)), store=kept, watching=said)

# %% [markdown]
# The second time the same batch came through, the body was read back instead of run.
# A new batch could not be: its key is made of what it contains, so a hit can only mean
# the very same input met the very same settled code. That is the whole value of a
# settled prefix — computed once per batch, read back every epoch after.
#
# ## What the run leaves behind
#
# `export` hands over the weights node by node, and a `Store` keeps them. Federated
# rounds are made of exactly this, and the level above has no type of its own either:
# a round is a `for`, and averaging is a function.

# %%
digest = store.keep("a-run/weights", trainer.export())
print("kept as", digest)
print("nodes  :", sorted(store.recall("a-run/weights")))

# %% [markdown]
# ## Not here yet
#
# Whether these gradients are any good — vanishing, exploding, stuck, a layer the
# optimizer never reaches. That is a judgement over the record, with thresholds worth
# arguing about, and it comes next; its rule is already set: a diagnosis must be
# reproducible from what was stored, without training again.
