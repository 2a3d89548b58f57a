"""somatize.health judges from the record alone: it loads, reads and diagnoses in a
process where torch and plotly cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap

from healthruns import chain, recorded

import somatize
from somatize.store import Store

SRC = os.path.dirname(os.path.dirname(somatize.__file__))

BLOCKED = textwrap.dedent("""
    import json, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "plotly", "numpy"):
                raise ImportError(name + " is blocked here")
            return None

    sys.meta_path.insert(0, Blocked())
    from somatize.cli import main
    from somatize.health import diagnose, history, seen
    from somatize.store import Store

    store = Store(sys.argv[1], durable=False)
    found = [f.as_dict() for f in diagnose(store, "r")]
    status = main(["health", sys.argv[1], "r"])
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "plotly", "numpy"})
    print(json.dumps({"found": found, "seen": seen(store, "r"), "status": status,
                      "loaded": loaded, "steps": len(history(store, "r")["body"]["act_zero"])}))
""")


def test_health_needs_neither_torch_nor_plotly(tmp_path):
    store = Store(str(tmp_path))
    recorded(store, "r", chain(12, body={"act_zero": 1.0, "grad_norm": 1.0}, head={"grad_norm": 1.0}))
    done = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC},
                          check=False)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["loaded"] == [] and said["status"] == 0 and said["steps"] == 12
    assert [(f["where"], f["what"], f["since"]) for f in said["found"]] == [("body", "dying", 1)]
    assert said["seen"] == {"body": {"act_zero": 1.0, "grad_norm": 1.0}, "head": {"grad_norm": 1.0}}
