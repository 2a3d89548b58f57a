"""The registries' table (``somatize._registries``) says who fills what: a fresh process
imports every part of the package that is installed, watching each call to a
registry's filling function, and every call must come from a module the table names,
every entry of a registry from such a call, and every module named must fill it."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from somatize._registries import PLACES, REGISTRIES, described, registry

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: watch the calls to each registry's filling function (by its code,
# found by file and name, since the owner may only be importable once its package has
# filled it), import every module of the package, then say who called, and whether each
# entry a registry holds was put there by one of those calls.
WATCH = textwrap.dedent("""
    import importlib, importlib.util, json, pkgutil, sys
    from pathlib import Path

    # the table comes from the test's process: importing the package here would fill
    # part of it before anything watched
    table = json.loads(sys.argv[1])
    root = Path(importlib.util.find_spec("somatize").submodule_search_locations[0])
    def source(module):
        parts = module.split(".")[1:]
        path = root.joinpath(*parts)
        return str(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))

    watched = {(source(r["owner"]), r["through"]): r["name"] for r in table}
    calls = {r["name"]: [] for r in table}

    def put(code, frame):
        # what the call adds: a key (dict registries) or an item (list registries)
        names = code.co_varnames[:code.co_argcount]
        if not names:  # hand_down(**functions)
            return ("keys", sorted(frame.f_locals[code.co_varnames[0]]))
        if len(names) == 1:
            return ("item", frame.f_locals[names[0]])
        return ("first", frame.f_locals[names[0]], tuple(frame.f_locals[n] for n in names))

    def watch(frame, event, arg):
        if event == "call":
            code = frame.f_code
            r = watched.get((code.co_filename, code.co_name))
            if r is not None:
                calls[r].append((frame.f_back.f_globals.get("__name__"), put(code, frame)))

    missing = {}
    sys.setprofile(watch)
    import somatize
    for info in pkgutil.walk_packages([str(root)], "somatize."):
        if info.name.split(".")[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:  # an extra that is not installed
            missing[info.name] = str(exc)
    sys.setprofile(None)

    report = {"missing": missing, "registries": {}}
    for r in table:
        held = getattr(importlib.import_module(r["owner"]), r["held_as"])
        put_there = []
        for _, what in calls[r["name"]]:
            if what[0] == "keys":
                put_there += what[1]
            elif what[0] == "item":
                put_there.append(what[1])
            else:
                put_there += [what[1], what[2]]
        entries = list(held)
        unaccounted = [repr(e) for e in entries if not any(e is p or e == p for p in put_there)]
        report["registries"][r["name"]] = {
            "callers": sorted({c for c, _ in calls[r["name"]]}),
            "entries": len(entries), "unaccounted": unaccounted}
    print(json.dumps(report))
""")


def watched() -> dict:
    table = json.dumps([dataclasses.asdict(r) for r in REGISTRIES])
    done = subprocess.run([sys.executable, "-c", WATCH, table], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_table_says_who_fills_every_registry_and_nobody_else_does():
    print("\n" + described())
    report = watched()
    for r in REGISTRIES:
        seen = report["registries"][r.name]
        imported = [m for m in r.filled_by if m not in report["missing"]]
        undeclared = [c for c in seen["callers"] if c not in r.filled_by]
        assert not undeclared, (f"{undeclared} fill the registry {r.name!r} ({r.owner}."
                                f"{r.through}), which _registries.py does not say")
        silent = [m for m in imported if m not in seen["callers"]]
        assert not silent, f"{silent} are said to fill {r.name!r} and did not"
        assert not seen["unaccounted"], (r.name, seen["unaccounted"])
        assert seen["entries"] > 0 or not imported, r.name
    print("not installed here:", sorted(report["missing"]) or "none")


def test_every_registry_is_named_where_it_is_held():
    import importlib

    for r in REGISTRIES:
        if r.owner.startswith("somatize.torch"):
            continue  # checked by the watched run above where torch is installed
        owner = importlib.import_module(r.owner)
        assert isinstance(getattr(owner, r.held_as), (dict, list)), r
        assert callable(getattr(owner, r.through)), r


def test_a_place_is_found_by_the_module_that_fills_it():
    assert {module for module, _ in PLACES.values()} == set(registry("places").filled_by)


def test_the_docs_name_each_registry_as_the_code_does():
    text = " ".join((ROOT / "docs" / "concepts.md").read_text().split())
    for r in REGISTRIES:
        assert f"`{r.through}`" in text, f"docs/concepts.md does not name {r.through}"
        assert f"| {r.name} |" in text, f"docs/concepts.md has no row for {r.name!r}"
    assert "somatize._registries" in text


def test_an_unknown_registry_is_named_with_the_known_ones():
    try:
        registry("nothing")
    except KeyError as exc:
        assert "codecs" in str(exc) and "verbs" in str(exc)
    else:
        raise AssertionError("an unknown registry was found")
