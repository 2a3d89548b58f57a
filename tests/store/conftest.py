"""The bucket store's fixtures, defined in s3server.py (a name tests can import)."""

from s3server import (  # noqa: F401  (pytest finds fixtures by name)
    credentials,
    forgetful_endpoint,
    lossy_endpoint,
    s3_endpoint,
)
