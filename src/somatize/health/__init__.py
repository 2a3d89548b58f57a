"""The health of a network, judged from its record: ``seen``, ``history``, ``diagnose``,
``Finding``, ``overlay``; ``panel`` draws it and ``command`` is ``somatize health``.

The Audit (``somatize.torch.Audit``) measures while a run trains and never judges;
everything here reads what it left in a store, with thresholds that are arguments,
so changing one never costs a training run — and nothing here imports torch.
"""

from __future__ import annotations

from ._command import command
from ._panel import panel, section
from ._read import history, seen
from ._rules import DEFAULTS, KINDS, Finding, diagnose, overlay

__all__ = ["DEFAULTS", "KINDS", "Finding", "command", "diagnose", "history", "overlay", "panel",
           "section", "seen"]
