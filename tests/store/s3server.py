"""A real S3-compatible server on loopback for the bucket store's tests: moto's own.

A module of its own rather than a conftest.py, so tests can import its helpers by a
name no other test folder uses; ``conftest.py`` beside it only re-exports the fixtures.

Started once per session as a separate process, on a free port, and stopped at the
end. Skipped cleanly where moto's server or boto3 is not installed.

It is moto's application served the way ``python -m moto.server`` serves it, with one
change: requests are handled one at a time. moto checks ``If-None-Match`` and then
writes, two steps another thread can come between; S3 makes them one, and the
tests of ``claim`` are about our side of that promise, not about moto's threads.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

KEY, SECRET = "soma-test-key", "soma-test-secret"

_SERVE = """
import sys, threading
from werkzeug.serving import run_simple
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)

app = DomainDispatcherApplication(create_backend_app)
one_at_a_time = threading.Lock()

def serialised(environ, start_response):
    with one_at_a_time:
        return list(app(environ, start_response))

run_simple("127.0.0.1", int(sys.argv[1]), serialised, threaded=True,
           request_handler=MotoRequestHandler)
"""


def free_port() -> int:
    """A loopback port free when asked (somebody may take it before it is used)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers(port: int) -> bool:
    """Whether something listens on this loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def s3_server(**environment: str) -> Iterator[str]:
    """Runs ``moto.server`` until the block ends; yields its endpoint URL."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    for _ in range(3):  # the port is free when chosen; somebody may take it before moto
        port = free_port()
        # Not a pipe: moto logs every request, and a pipe nobody reads fills and stalls it.
        log = tempfile.TemporaryFile()
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(port)],
            stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **environment})
        deadline = time.monotonic() + 30
        while server.poll() is None and not answers(port):
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto's server did not answer within 30 s")
            time.sleep(0.05)
        if server.poll() is None:
            break
        log.seek(0)
        said = log.read()[-2000:].decode(errors="replace")
        log.close()
    else:
        raise RuntimeError(f"moto's server would not start: {said}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@functools.cache
def raw_client(endpoint: str):
    """A plain boto3 client on ``endpoint``: what an administrator would use."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
        aws_secret_access_key=SECRET, config=Config(s3={"addressing_style": "path"}))


def make_bucket(endpoint: str, bucket: str) -> None:
    """Creates ``bucket`` at ``endpoint``, as an administrator would before a run."""
    raw_client(endpoint).create_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def credentials(monkeypatch):
    """The AWS variables a user would set, so stores opened here read their key there."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


class _Relay(http.server.BaseHTTPRequestHandler):
    """Passes every request on to the real server, and answers what it answered, except
    for what ``forgets`` and ``loses`` say it should get wrong."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    forgets = False  # drop If-None-Match: a server that takes the condition and ignores it
    loses: set[str] | None = None  # paths whose first conditional write's answer is lost

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conditional = "if-none-match" in {k.lower() for k in self.headers}
        headers = {k: v for k, v in self.headers.items()
                   if not (self.forgets and k.lower() == "if-none-match")}
        connection = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            answer = connection.getresponse()
            payload = answer.read()
        finally:
            connection.close()
        if conditional and self.loses is not None and self.path not in self.loses:
            self.loses.add(self.path)  # written upstream; the writer never hears so
            self.close_connection = True
            return
        self.send_response(answer.status, answer.reason)
        for key, value in answer.getheaders():
            if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _relay

    def log_message(self, *args) -> None:  # quiet: the test output is for the tests
        pass


@contextlib.contextmanager
def relay(endpoint: str, **wrong) -> Iterator[str]:
    """A loopback endpoint in front of ``endpoint`` that gets what ``wrong`` says wrong."""
    host, port = endpoint.removeprefix("http://").split(":")
    handler = type("Relay", (_Relay,), {"upstream": (host, int(port)), **wrong})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()


@pytest.fixture
def forgetful_endpoint(s3_endpoint) -> Iterator[str]:
    """An endpoint that takes If-None-Match and writes anyway."""
    with relay(s3_endpoint, forgets=True) as endpoint:
        yield endpoint


@pytest.fixture
def lossy_endpoint(s3_endpoint) -> Iterator[str]:
    """An endpoint that makes each first conditional write and hangs up without saying so."""
    with relay(s3_endpoint, loses=set()) as endpoint:
        yield endpoint


class Users:
    """The endpoint of a server that checks every request against IAM policies, and the
    credentials of its users: ``writer`` may do anything, ``reader`` may list and read
    but not write, and may not read ``names/hidden`` in any bucket."""

    def __init__(self, endpoint: str, keys: dict[str, tuple[str, str]]):
        self.endpoint, self.keys = endpoint, keys

    def client(self, user: str):
        import boto3
        from botocore.config import Config

        key, secret = self.keys[user]
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=key,
            aws_secret_access_key=secret, config=Config(s3={"addressing_style": "path"}))


_POLICIES = {
    "writer": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": "*"}],
    "reader": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"},
               {"Effect": "Deny", "Action": ["s3:GetObject"],
                "Resource": "arn:aws:s3:::*/names/hidden"}],
}


@pytest.fixture(scope="session")
def iam_endpoint() -> Iterator[Users]:
    """A second moto server, one that enforces IAM: its first six requests make the two
    users (unchecked, as moto allows), and every request after is checked."""
    import json

    import boto3

    with s3_server(INITIAL_NO_AUTH_ACTION_COUNT=str(3 * len(_POLICIES))) as endpoint:
        iam = boto3.session.Session().client(
            "iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
            aws_secret_access_key=SECRET)
        keys = {}
        for user, statements in _POLICIES.items():
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="store", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": statements}))
            made = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (made["AccessKeyId"], made["SecretAccessKey"])
        yield Users(endpoint, keys)
