"""The README's "On a Ray cluster" runs as written, on the session's cluster."""

import math
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_section_runs_as_written(cluster):
    text = README.read_text()
    section = text.split("## On a Ray cluster", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    scope = {"__name__": "__main__"}  # as a script: its classes travel by value
    exec(compile(code, str(README), "exec"), scope)
    assert len(scope["losses"]) == 3 and all(math.isfinite(x) for x in scope["losses"])
