"""A session's verbs, as somatize.torch answers them (somatize._verbs): each is answered
where its feature lives, registered wherever a trainer can be rebuilt, the trainer
itself imports none of those features, and nothing but data crosses the gradient
channel any more."""

import ast
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from somatize import Ctx, DeclarationError, Opaque
from somatize._verbs import SEEDING, VERBS, verb
from somatize.torch import Split, envelope
from somatize.torch._checkpoint import VERBS as CHECKPOINT_VERBS
from somatize.torch._envelope import KEY
from somatize.torch._random import VERBS as RANDOM_VERBS
from somatize.torch._shared import VERBS as SHARED_VERBS
from somatize.torch._weights import VERBS as WEIGHTS_VERBS
from somatize.torch._weights import weights_verb

TORCH = Path(__file__).resolve().parents[2] / "src" / "somatize" / "torch"


def trained():
    torch.manual_seed(0)
    node = torch.nn.Linear(3, 2)
    return node, Split(torch.optim.SGD, lr=0.1).of(node)


def test_a_worker_that_imports_somatize_torch_answers_every_verb():
    """A worker rebuilds a trainer from a pickle; the package it comes from registers
    the verbs on the way, so its session answers them."""
    node, split = trained()
    blob = pickle.dumps({"n": split})
    code = textwrap.dedent("""
        import pickle, sys
        nodes = pickle.loads(sys.stdin.buffer.read())
        from somatize._verbs import VERBS
        weights = VERBS["weights"](nodes, {"node": "n"})
        kept = VERBS["state"](nodes, {"node": "n"})
        assert sorted(weights) == sorted(kept["weights"]) == ["bias", "weight"], weights
        assert kept["learning"]["type"] == "Split", kept
        print(sorted(VERBS))
    """)
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == str(sorted(
        ["weights", "load", "mode", "state", "restore", "random", "set_random", "seed",
         "shared_order", "evaluating"]))


def test_each_verb_is_answered_by_its_features_handler():
    node, split = trained()
    nodes = {"n": split}
    asked = VERBS["weights"](nodes, {"node": "n"})
    assert torch.equal(asked["weight"], node.weight)
    assert asked["weight"] is not node.weight  # a copy: training on changes nothing
    doubled = {k: 2 * v for k, v in asked.items()}
    assert VERBS["load"](nodes, {"node": "n", "weights": doubled, "check": True}) is True
    assert torch.equal(node.weight, asked["weight"])  # checked only
    VERBS["load"](nodes, {"node": "n", "weights": doubled, "check": False})
    assert torch.equal(node.weight, doubled["weight"])
    kept = VERBS["state"](nodes, {"node": "n"})
    assert kept["grads"] == {} and kept["learning"]["optimizer"] is None  # never stepped
    back = {"node": "n", "weights": asked, "grads": {}, "learning": kept["learning"],
            "check": False}
    assert VERBS["restore"](nodes, back) == {"sharing": []}
    assert torch.equal(node.weight, asked["weight"])
    assert split.held is None and split.given is None  # no verb is an activation
    node.train()
    assert VERBS["mode"]({"n": split}, {"train": False}) == ["n"] and not node.training
    with pytest.raises(DeclarationError, match="node 'm' is not trained where it runs"):
        VERBS["weights"]({"m": node}, {"node": "m"})


def test_a_map_of_one_reserved_key_is_an_activation_now_not_a_message():
    """Nothing but envelopes is read off the gradient channel: a one-key map, reserved
    or not, is an activation like any other value."""
    node, split = trained()
    split.entering(torch.randn(4, 3), Ctx())
    made = {"__soma_weights__": True}
    assert split.forward(made, Ctx()) is made and split.held is made
    # a map of tensors is kept as the activation, and what goes on is cut from it, as
    # a lone tensor would be
    split.entering(torch.randn(4, 3), Ctx())
    made = {"out": torch.randn(4, 2, requires_grad=True) * 2}
    went = split.forward(made, Ctx())
    assert split.held is made
    assert type(went) is Opaque and went.value.keys() == {"out"}
    assert torch.equal(went.value["out"], made["out"]) and not went.value["out"].requires_grad


def test_a_verbs_name_is_one_features_and_never_end():
    verb("weights", weights_verb)  # the same handler again: nothing changes
    with pytest.raises(DeclarationError, match="answered by weights_verb already"):
        verb("weights", lambda nodes, asked: None)
    with pytest.raises(DeclarationError, match="'end'.*every host answers itself"):
        verb("end", weights_verb)
    assert SEEDING == {"seed", "set_random"}
    node, split = trained()
    split.entering(torch.randn(4, 3), Ctx())
    split.forward(node(split.given), Ctx())
    assert split.forward(envelope(torch.ones(4, 2)), Ctx())[KEY] is not None  # still learnt


def test_the_handlers_are_the_features_and_the_trainer_imports_none_of_them():
    assert set(WEIGHTS_VERBS) == {"weights", "load", "mode"}
    assert set(CHECKPOINT_VERBS) == {"state", "restore"}
    assert set(RANDOM_VERBS) == {"random", "set_random", "seed"}
    assert set(SHARED_VERBS) == {"shared_order"}
    imports = _imports()
    # the core only, and the walk through a value's tensors, which is no feature and
    # imports nothing of this package itself
    assert imports["_learning"] <= {"_tensors", "_envelope", "_seat"}, imports["_learning"]
    assert imports["_seat"] <= {"_tensors", "_envelope"}, imports["_seat"]
    assert imports["_envelope"] <= {"_tensors"}, imports["_envelope"]
    assert imports["_tensors"] == set(), imports["_tensors"]
    assert not {"_learning", "_seat"} & (imports["_weights"] | imports["_checkpoint"])
    assert _circle(imports) is None, _circle(imports)


def test_no_reserved_control_key_is_left_in_the_package():
    source = "\n".join(p.read_text() for p in (TORCH.parent).rglob("*.py"))
    for key in ("__soma_weights__", "__soma_load__", "__soma_state__", "__soma_restore__",
                "__soma_shared_order__"):
        assert key not in source, key


def _imports() -> dict[str, set[str]]:
    """Each module of somatize.torch, and the modules of it that it imports, at any depth
    of its code (a lazy import is still an import)."""
    found = {}
    for path in TORCH.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module.split(".")[0]} if node.module else {
                    a.name for a in node.names}
        found[path.stem] = names - {"__init__"}
    return found


def _circle(imports: dict[str, set[str]]) -> list[str] | None:
    """A path ``a -> b -> a`` among the modules below the package's face, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done or module not in imports:
            return None
        for imported in sorted(imports[module]):
            found = visit(imported, path + [module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(imports):
        if module != "__init__":
            found = visit(module, [])
            if found:
                return found
    return None
