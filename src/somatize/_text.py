"""Text for a terminal: rows aligned under a header."""

from __future__ import annotations

__all__ = ["table"]


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Rows aligned under a header; the columns in ``right`` flush right (numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(row) for row in rows]
