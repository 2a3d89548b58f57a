"""The web tests' fixtures: the bucket store's real S3 server, from tests/store."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))

from s3server import credentials, s3_endpoint  # noqa: E402,F401  (fixtures, found by name)
