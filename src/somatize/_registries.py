"""What each layer hands down as it loads: every registry of the package, in one table.

A module never imports a layer above its own (``tests/test_structure.py``), so where it
needs what only a higher layer knows — how a tensor is written down, which verbs a
session answers, what a ``{host: Worker}`` map stands for — it keeps a registry, and
the higher layer fills it when it is imported. The import checks cannot see such a
dependency, so it is written down here instead: each registry, what it maps, the
module that holds it and the function that fills it, and the modules that call that
function. ``tests/test_registries.py`` prints the table, imports every part of the
package that is installed, and fails on a call from a module the table does not name.

The registries stay in the modules that use them (a lookup there is a dict read, not
a call through here); this module is data and imports nothing but ``_text``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._text import table

__all__ = ["PLACES", "REGISTRIES", "Registry", "described", "registry"]


@dataclass(frozen=True)
class Registry:
    """One registry: its ``name``; what it ``maps``; the module that holds it
    (``owner``) and the name it goes by there (``held_as``); the owner's function that
    adds to it (``through``); and the modules that call that function as they load
    (``filled_by``). ``users`` says that code outside the package fills it too, through
    a public function."""

    name: str
    maps: str
    owner: str
    held_as: str
    through: str
    filled_by: tuple[str, ...]
    users: bool = False


#: Where each place a worker can be besides a socket is filled in, and the extra it
#: needs: ``Worker.on_<name>`` imports the module by this name the first time it is
#: asked for, so nobody has to import it first (the ``places`` registry's fillers).
PLACES: dict[str, tuple[str, str]] = {"ray": ("somatize.ray", "ray"),
                                      "in_process": ("somatize.wire.inprocess", "wire")}

REGISTRIES: tuple[Registry, ...] = (
    Registry("codecs", "a codec's kind -> its type, dump and load",
             "somatize._codec", "_by_kind", "codec", ("somatize.torch._codec",), users=True),
    Registry("graph's walk", "a name -> the walk's function the graph's facade calls",
             "somatize._graph", "_above", "hand_down", ("somatize._engine",)),
    Registry("readers first", "hooks run before any Store reads a name",
             "somatize.store._store", "_readers_first", "before_reading",
             ("somatize.record._recorder",)),
    Registry("unbound answers", "hooks asked for a name nobody bound",
             "somatize.store._store", "_standing_in", "answers_unbound",
             ("somatize.record._read",)),
    Registry("runners", "a worker's type -> the runner a {host: worker} map stands for",
             "somatize._slices", "_stand_ins", "stands_for", ("somatize.wire.broker",)),
    Registry("verbs", "a verb's name -> its handler on a host",
             "somatize._verbs", "VERBS", "verb", ("somatize.torch",)),
    Registry("random state", "how the process's random state is read and set",
             "somatize._verbs", "RANDOM", "draws", ("somatize.torch",)),
    Registry("places", "a name -> what answers Worker.on_<name>",
             "somatize.wire.declare", "_places", "provides",
             tuple(module for module, _ in PLACES.values())),
    Registry("core sharing", "hooks told the threads left when a worker child starts",
             "somatize.wire.declare", "_sharing", "sharing_cores", ("somatize.torch",)),
    Registry("shared trainers", "what starts a trainer several clients share",
             "somatize.torch._seat", "_STARTS", "shared_by", ("somatize.torch",)),
)


def registry(name: str) -> Registry:
    """The registry called ``name``."""
    for each in REGISTRIES:
        if each.name == name:
            return each
    raise KeyError(f"no registry is called {name!r}; they are "
                   f"{', '.join(r.name for r in REGISTRIES)}")


def described() -> str:
    """The table, one registry a row, as a terminal shows it."""
    rows = [[r.name, r.maps, f"{r.owner}.{r.held_as}", f"{r.through}()",
             ", ".join(r.filled_by) + (" and users" if r.users else "")] for r in REGISTRIES]
    return "\n".join(table(["registry", "maps", "held in", "filled through", "filled by"], rows))
