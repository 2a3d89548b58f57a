"""Training, which only makes sense with torch in front of you.

The core knows nothing of losses, gradients or optimizers, and this package is where
they live: a ``Trainer`` takes a graph and trains it from outside, so the same graph
can be trained in several ways without being touched::

    from somatize.torch import Trainer, parameters

    t = Trainer(g, objective=torch.nn.functional.cross_entropy,
                optimizer=torch.optim.Adam(parameters(g), lr=1e-3))
    t.fit(data, epochs=10)

``module(m)`` makes an existing ``nn.Module`` a node in one call, its weights and
export keys its own. ``trains={"body": Split(SGD, lr=0.1)}`` trains a node where it runs — on a worker,
say — through a ``Learning`` that stands beside it; ``architecture`` and ``proxies``
say what a network is made of and rank candidates before any training.

Importing it also registers how a tensor is written down (``somatize.torch._codec``),
which is what lets a graph key, keep and recall tensors; the verbs a session's trainers
answer on their host (their weights, their part of a checkpoint, the session's random
state: each module's ``VERBS``, into ``somatize._verbs``); and how a host swaps a
session's random state in (``_random.taken``/``put``): a worker imports this package
before it can rebuild a trainer. The name does not shadow the real torch: imports are absolute, so ``import
torch`` in here is the usual one.
"""

from __future__ import annotations

from .._errors import NoGradient, OutOfStep
from .._verbs import draws as _draws
from .._verbs import verb as _verb
from ..wire.declare import sharing_cores as _sharing_cores
from ._aggregate import bulyan, fedavg, fedmedian, fedtrimmedavg, krum
from ._architecture import architecture, kind_of, traced
from ._audit import Audit
from ._checkpoint import VERBS as _CHECKPOINT_VERBS
from ._codec import register as _register
from ._cores import keep as _keep_threads
from ._dp import ClientPrivacy, noise_for, privacy_spent
from ._evaluate import evaluate
from ._federated import gather
from ._fedprox import fedprox
from ._envelope import envelope, gradient
from ._learning import Learning, Split
from ._seat import shared_by as _shared_by
from ._module import module
from ._privacy import Protection, run_norm_leak
from ._predicting import VERBS as _PREDICTING_VERBS
from ._probe import probe
from ._random import VERBS as _RANDOM_VERBS
from ._random import put as _put
from ._random import taken as _taken
from ._server import FedAdagrad, FedAdam, FedAvgM, FedYogi, ServerOptimizer
from ._shared import VERBS as _SHARED_VERBS
from ._shared import Shared as _Shared
from ._proxies import EVERY, proxies, proxy
from ._trainer import Result, Trainer
from ._weights import VERBS as _WEIGHTS_VERBS
from ._weights import freeze, parameters

_register()
for _name, _handler in {**_WEIGHTS_VERBS, **_CHECKPOINT_VERBS, **_RANDOM_VERBS,
                         **_SHARED_VERBS, **_PREDICTING_VERBS}.items():
    _verb(_name, _handler, seeds=_name in ("seed", "set_random"))
del _name, _handler
_draws(_taken, _put)
_shared_by(_Shared)
_sharing_cores(_keep_threads)  # a worker started beside this process gets half the cores

__all__ = [
    "Audit",
    "ClientPrivacy",
    "EVERY",
    "FedAdagrad",
    "FedAdam",
    "FedAvgM",
    "FedYogi",
    "Learning",
    "NoGradient",
    "OutOfStep",
    "Protection",
    "Result",
    "ServerOptimizer",
    "Split",
    "Trainer",
    "architecture",
    "bulyan",
    "envelope",
    "evaluate",
    "fedavg",
    "fedmedian",
    "fedprox",
    "fedtrimmedavg",
    "freeze",
    "gather",
    "gradient",
    "kind_of",
    "krum",
    "module",
    "noise_for",
    "parameters",
    "privacy_spent",
    "probe",
    "proxies",
    "proxy",
    "run_norm_leak",
    "traced",
]
