"""What a node may wrap its answer in: ``Opaque`` (crosses the graph untouched) and
``Done`` (a finished answer). Here on their own, beneath everything that reads them —
the codecs and the keys as much as the node — so that none of those imports another to
know them."""

from __future__ import annotations

from typing import Any

__all__ = ["Done", "Opaque"]


class Opaque:
    """A value that crosses the graph untouched: the node below receives it unwrapped."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Opaque({type(self.value).__qualname__})"


class Done:
    """A finished answer; the walk unwraps it exactly like a plain return."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Done({self.value!r})"
