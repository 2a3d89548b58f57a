"""The shape of the code, read from its source: layers that only point down, no import
cycles (function-level imports included), and nobody outside ``_graph.py`` touching a
Graph's private fields. The layers are the ones ``docs/concepts.md`` draws."""

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "somatize"

# The layers, lowest first; a module may import its own layer and those below it.
LAYERS = [
    ["somatize._errors", "somatize._optional", "somatize._version", "somatize._text", "somatize._dsl",
     "somatize._opaque", "somatize._node", "somatize._codec", "somatize._keys", "somatize._plan", "somatize._verbs",
     "somatize._registries"],
    ["somatize._graph", "somatize._described", "somatize.viz"],
    ["somatize.store"],
    ["somatize._walk", "somatize._slices", "somatize._items", "somatize._remember",
     "somatize._transpose", "somatize._engine"],
    ["somatize.record"],
    ["somatize.wire", "somatize.worker"],
    ["somatize.ray"],
    ["somatize.health"],
    ["somatize.torch"],
    ["somatize.cli", "somatize.web", "somatize.__main__", "somatize"],
]

# What each part may import from outside the standard library (optional extras only
# where the part is the extra). Everything else must stand on the standard library.
THIRD_PARTY = {
    "somatize.viz": {"plotly"},
    "somatize.store.bucket": {"boto3", "botocore"},
    "somatize.record": {"plotly", "IPython", "tensorboard", "mlflow"},
    "somatize.health": {"plotly"},
    "somatize.wire": {"msgpack", "cloudpickle"},
    "somatize.ray": {"ray"},
    "somatize.torch": {"torch", "numpy", "safetensors", "tqdm", "ipywidgets"},
    "somatize.web": {"starlette", "uvicorn", "anyio", "plotly"},
    "somatize.cli": set(),
}

GRAPH_PRIVATE = {"_impl", "_preds", "_succs", "_edges", "_devices", "_hosts", "_cached",
                 "_frozen", "_mapped", "_declarations", "_unwritable", "_fingerprints",
                 "_data", "_compiled", "_add", "_connect", "_known", "_path", "_changed"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """Every module ``name`` imports, anywhere in it (functions included), resolved to
    the deepest module of ours it names, and the packages of ours above that one which
    the import runs first (``parents``); third-party ones by their top name."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):  # what only a type checker reads is not an import
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                deeper = f"{origin}.{alias.name}"
                found.append((deeper if deeper in known else origin, node.lineno))
    return found + [(parent, line) for target, line in found
                    for parent in parents(target, known) if not name.startswith(parent + ".")]


def parents(target: str, known: set[str]) -> list[str]:
    """The packages of ours that Python imports before ``target`` (each ``__init__`` on
    the way down), short of the root, which every import of ours runs first anyway.
    Importing ``somatize.ray.worker`` runs ``somatize.ray`` first, so an import of the
    one is an import of the other too; a module's own packages are left out, since they
    are being imported already when it is."""
    parts = target.split(".")
    return [p for p in (".".join(parts[:k]) for k in range(2, len(parts))) if p in known]


def layer_of(name: str) -> int | None:
    best = None
    for rank, members in enumerate(LAYERS):
        for member in members:
            if name == member or name.startswith(member + ".") and member != "somatize":
                if best is None or len(member) > best[1]:
                    best = (rank, len(member))
    return None if best is None else best[0]


def graph_of_imports() -> dict[str, list[tuple[str, int]]]:
    found = sources()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def test_every_module_has_a_layer():
    assert [n for n in sources() if layer_of(n) is None] == []


def test_imports_only_point_down_the_layers():
    wrong = []
    for name, targets in graph_of_imports().items():
        for target, line in targets:
            if target == "somatize" or target.startswith("somatize."):
                if target == "somatize" and name != "somatize":
                    wrong.append(f"{name}:{line} imports the package face 'somatize'")
                elif layer_of(target) is not None and layer_of(target) > layer_of(name):
                    wrong.append(f"{name}:{line} imports {target}, a layer above it")
    assert wrong == []


def test_there_is_no_import_cycle():
    edges = {name: {t for t, _ in targets if t in sources() and t != name}
             for name, targets in graph_of_imports().items()}
    colour: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        colour[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in colour:
                visit(nxt, path + [nxt])
        colour[node] = 2

    for node in sorted(edges):
        if node not in colour:
            visit(node, [node])
    assert cycles == []


def test_an_import_counts_the_packages_python_runs_first():
    """``somatize.ray`` imports ``wire.declare`` by name, which runs the package
    ``somatize.wire`` first: so a cycle through a package's ``__init__`` is seen."""
    targets = {t for t, _ in graph_of_imports()["somatize.ray"]}
    assert {"somatize.wire.declare", "somatize.wire"} <= targets


def test_the_core_stands_on_the_standard_library():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = []
    for name, targets in graph_of_imports().items():
        allowed = set()
        for part, extra in THIRD_PARTY.items():
            if name == part or name.startswith(part + "."):
                allowed |= extra
        for target, line in targets:
            top = target.split(".")[0]
            if top and top != "somatize" and top not in stdlib and top not in allowed:
                wrong.append(f"{name}:{line} imports {target}")
    assert wrong == []


def test_nobody_outside_graph_touches_a_graphs_private_fields():
    wrong = []
    for name, path in sources().items():
        if name == "somatize._graph":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in GRAPH_PRIVATE
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                wrong.append(f"{name}:{node.lineno} reads .{node.attr} of another object")
    assert wrong == []


def test_every_layer_names_modules_that_exist():
    found = sources()
    assert [m for layer in LAYERS for m in layer if m not in found] == []
    assert [part for part in THIRD_PARTY if part not in found] == []


def test_what_each_part_may_import_is_the_list_the_docs_give():
    text = " ".join((SRC.parents[0] / "docs" / "concepts.md").read_text().split())
    for part, extras in THIRD_PARTY.items():
        if extras:
            listed = ", ".join(sorted(extras, key=str.lower))
            shown = part.replace("somatize.", "")
            assert f"`{shown}`: {listed}" in text, f"docs/concepts.md does not list {part}'s"


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_the_layers_are_the_ones_the_docs_draw(layer):
    text = (SRC.parents[0] / "docs" / "concepts.md").read_text()
    for member in LAYERS[layer]:
        shown = member.replace("somatize.", "").replace("somatize", "__init__")
        assert f"`{shown}`" in text, f"docs/concepts.md does not place {member}"
