"""Messages to a trainer (somatize.torch._learning.answers): each is answered where its
feature lives, registered wherever a trainer can be rebuilt, and the trainer itself
imports none of those features."""

import ast
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from somatize import Ctx, DeclarationError, Opaque
from somatize.torch import Split, envelope
from somatize.torch._checkpoint import ANSWERS as CHECKPOINT_ANSWERS
from somatize.torch._checkpoint import RESTORE, STATE
from somatize.torch._learning import KEY, answers
from somatize.torch._weights import ANSWERS as WEIGHTS_ANSWERS
from somatize.torch._weights import ASKING, LOADING, answer_weights

TORCH = Path(__file__).resolve().parents[2] / "src" / "somatize" / "torch"


def trained():
    torch.manual_seed(0)
    node = torch.nn.Linear(3, 2)
    return node, Split(torch.optim.SGD, lr=0.1).of(node)


def test_a_trainer_rebuilt_from_its_pickle_alone_answers_every_message():
    """A worker rebuilds a trainer from a pickle, importing nothing by hand: the
    package it comes from registers the handlers on the way."""
    node, split = trained()
    blob = pickle.dumps(split)
    code = textwrap.dedent(f"""
        import pickle, sys
        split = pickle.loads(sys.stdin.buffer.read())
        from somatize import Ctx
        weights = split.forward({{{ASKING!r}: True}}, Ctx())[{ASKING!r}]
        kept = split.forward({{{STATE!r}: True}}, Ctx())[{STATE!r}]
        assert sorted(weights) == sorted(kept["weights"]) == ["bias", "weight"], weights
        assert kept["learning"]["type"] == "Split", kept
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "ok"


def test_each_message_is_answered_by_its_features_handler_under_its_own_key():
    node, split = trained()
    asked = split.forward({ASKING: True}, Ctx())
    assert list(asked) == [ASKING] and torch.equal(asked[ASKING]["weight"], node.weight)
    assert asked[ASKING]["weight"] is not node.weight  # a copy: training on changes nothing
    doubled = {k: 2 * v for k, v in asked[ASKING].items()}
    said = split.forward({LOADING: {"node": "n", "weights": doubled, "check": True}}, Ctx())
    assert said == {LOADING: True} and torch.equal(node.weight, asked[ASKING]["weight"])
    split.forward({LOADING: {"node": "n", "weights": doubled, "check": False}}, Ctx())
    assert torch.equal(node.weight, doubled["weight"])
    kept = split.forward({STATE: True}, Ctx())[STATE]
    assert kept["grads"] == {} and kept["learning"]["optimizer"] is None  # never stepped
    back = {"node": "n", "weights": asked[ASKING], "grads": {}, "learning": kept["learning"],
            "check": False}
    assert split.forward({RESTORE: back}, Ctx()) == {RESTORE: True}
    assert torch.equal(node.weight, asked[ASKING]["weight"])
    assert split.held is None and split.given is None  # no message is an activation


def test_an_activation_that_is_a_map_of_one_key_is_still_an_activation():
    node, split = trained()
    split.entering(torch.randn(4, 3), Ctx())
    made = {"out": torch.randn(4, 2, requires_grad=True) * 2}
    went = split.forward(made, Ctx())
    assert split.held is made  # kept as the activation, not answered as a message
    # ...and what goes on is cut from it, as a lone tensor would be
    assert type(went) is Opaque and went.value.keys() == {"out"}
    assert torch.equal(went.value["out"], made["out"]) and not went.value["out"].requires_grad


def test_a_message_key_is_one_features_reserved_and_never_an_envelopes():
    answers(WEIGHTS_ANSWERS)  # the same handlers again: nothing changes
    with pytest.raises(DeclarationError, match="answered by answer_weights already"):
        answers({ASKING: lambda learning, asked: None})
    with pytest.raises(DeclarationError, match="an envelope uses it"):
        answers({KEY: answer_weights})
    with pytest.raises(DeclarationError, match="an activation could.*'__soma_'"):
        answers({"weights": answer_weights})
    with pytest.raises(DeclarationError, match="'__soma_nobody__'.*nothing in this process"):
        trained()[1].forward({"__soma_nobody__": True}, Ctx())
    node, split = trained()
    split.entering(torch.randn(4, 3), Ctx())
    split.forward(node(split.given), Ctx())
    assert split.forward(envelope(torch.ones(4, 2)), Ctx())[KEY] is not None  # still learnt
    assert split.forward({ASKING: True}, Ctx())[ASKING].keys() == {"weight", "bias"}


def test_the_handlers_are_the_features_and_the_trainer_imports_none_of_them():
    assert set(WEIGHTS_ANSWERS) == {ASKING, LOADING}
    assert set(CHECKPOINT_ANSWERS) == {STATE, RESTORE}
    imports = _imports()
    # the core only, and the walk through a value's tensors, which is no feature and
    # imports nothing of this package itself
    assert imports["_learning"] <= {"_tensors"}, imports["_learning"]
    assert imports["_tensors"] == set(), imports["_tensors"]
    assert "_learning" not in imports["_weights"] | imports["_checkpoint"]
    assert _circle(imports) is None, _circle(imports)


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
