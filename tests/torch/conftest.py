"""What the torch tests share: torch itself. Where it is missing the whole directory
is left out, and the header of the run says why, so no file repeats a skip block."""

import importlib.util

HAS_TORCH = importlib.util.find_spec("torch") is not None

if not HAS_TORCH:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if not HAS_TORCH:
        return "tests/torch: skipped, torch is not installed (pip install 'somatize[torch]')"
    return None
