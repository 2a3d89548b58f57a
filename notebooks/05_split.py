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
# # 05 — Training the half that is not here
#
# A graph with a slice on another machine trains as one. What crosses a wire is a
# value, not the autograd graph that made it, so a `backward()` here reaches nothing
# there. `trains={"body": Split(SGD, lr=0.1)}` puts a trainer beside the node — on the
# machine where it runs — which keeps the activation, is handed the gradient of the
# seam, carries on with the chain rule, steps, and hands back the gradient of its
# input. The node never learns any of it happened.
#
# Here the "other machine" is a worker this notebook starts: `Worker.generic()`, a real
# process on a real socket, authenticated with a fresh token.

# %%
import torch

from somatize import Broker, Done, Graph, Node, Opaque, Worker
from somatize.torch import Split, Trainer, parameters


class Body(Node):  # a node; it knows nothing about any of this
    def __init__(self):
        self.lin = torch.nn.Linear(8, 6)

    def forward(self, x, ctx):
        return Done(Opaque(self.lin(x).relu()))

    def parameters(self):
        return list(self.lin.parameters())


class Head(Node):
    def __init__(self):
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x, ctx):
        return Opaque(self.lin(x))

    def parameters(self):
        return list(self.lin.parameters())


def data(seed=1, batches=20):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator),
             torch.randint(0, 3, (16,), generator=generator)) for _ in range(batches)]


def built(host=None):
    torch.manual_seed(0)
    body = Body().named("body")
    return Graph.somatize((body.at(host) if host else body) >> Head().named("head"))

# %% [markdown]
# ## The far half on a worker
#
# The classes above live in this notebook, which the worker cannot import, so the
# worker is started in `"network"` mode: the code travels with the catalog.

# %%
cross_entropy = torch.nn.functional.cross_entropy
worker = Worker.generic(mode="network")
g = built("gpu")
trains = {"body": Split(torch.optim.SGD, lr=0.1)}   # what trains it, where it runs
split = Trainer(g, objective=cross_entropy,
                optimizer=torch.optim.SGD(parameters(g, without=trains), lr=0.1),  # the half here
                trains=trains,                                                    # the half there
                broker=Broker.embedded({"gpu": worker}))
far = split.fit(data(), epochs=3)
print(f"split: {len(far.history)} steps, loss {far.history[0]:.4f} -> {far.loss:.4f}")

# %% [markdown]
# ## The same net, trained in one piece
#
# Same weights, same batches, one optimizer here. If splitting changed who writes the
# loop and not the arithmetic, the losses are the same — not close: equal.

# %%
whole_g = built()
whole = Trainer(whole_g, objective=cross_entropy,
                optimizer=torch.optim.SGD(parameters(whole_g), lr=0.1))
here = whole.fit(data(), epochs=3)
print("losses equal, step for step:", here.history == far.history)
weights_there = split.export()["body"]  # asked of the trainer on the worker
weights_here = whole.export()["body"]
print("body's weights equal:", all(torch.equal(weights_there[k], weights_here[k])
                                   for k in weights_here))

# %% [markdown]
# What the graph is did not change: same nodes, same edges, same plan. The trainer's
# two positions live in a private copy the Trainer drives stage by stage.

# %%
print(g.nodes(), g.edges())
print(g.plan())
worker.close()
