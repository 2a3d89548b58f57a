"""What the Ray tests share besides fixtures."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cluster_env() -> dict:
    """What a cluster's processes need to import the somatize under test, and raynets."""
    return {"PYTHONPATH": os.pathsep.join(p for p in [str(HERE), *sys.path] if p)}
