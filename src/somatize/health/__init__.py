"""The health of a network, judged from its record: ``seen``, ``history``, ``diagnose``,
``Finding``, ``overlay``; ``panel`` draws it, ``report`` writes the whole report of a
run, and ``findings_told`` is what ``somatize health`` prints.

The Audit (``somatize.torch.Audit``) measures while a run trains and never judges;
everything here reads what it left in a store, with thresholds that are arguments,
so changing one never costs a training run — and nothing here imports torch.
"""

from __future__ import annotations

from ._panel import panel, section
from ._read import history, judged_facts, seen
from ._report import drawing, report
from ._rules import DEFAULTS, KINDS, Finding, brief, diagnose, findings_of, overlay, thresholds_from
from ._told import findings_told

__all__ = ["DEFAULTS", "KINDS", "Finding", "brief", "diagnose", "drawing", "findings_of",
           "findings_told", "history", "judged_facts", "overlay", "panel", "report", "section",
           "seen", "thresholds_from"]
