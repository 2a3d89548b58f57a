"""A graph drawn: ``figure(graph, overlay=None, inside=None)``, what ``Graph.figure``
calls. Needs plotly (the ``viz`` extra); the layout underneath is plain Python, and so
is ``host_colours``, the colour each host is drawn in, which the record's figures share.
"""

from __future__ import annotations

from ._draw import figure, host_colours

__all__ = ["figure", "host_colours"]
