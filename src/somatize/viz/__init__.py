"""A graph drawn: ``figure(graph, overlay=None, inside=None)``, what ``Graph.figure``
calls. Needs plotly (the ``viz`` extra); the layout underneath is plain Python.
"""

from __future__ import annotations

from ._draw import figure

__all__ = ["figure"]
