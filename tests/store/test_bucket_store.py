"""The bucket store: the shared contract against a real S3 server, then what only a
bucket can get wrong — conditional writes, the probe, credentials, addressing."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from s3server import KEY, SECRET, make_bucket, raw_client, s3_server
from contract import StoreContract

import somatize
from somatize import BadName, CorruptObject, StoreError
from somatize.record import Recorder
from somatize.store import Store

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from somatize.store.bucket import BucketBackend  # noqa: E402

SRC = str(Path(somatize.__file__).resolve().parent.parent)


def fresh_bucket(endpoint: str) -> str:
    bucket = "soma-" + secrets.token_hex(6)
    make_bucket(endpoint, bucket)
    return bucket


def keys(endpoint: str, bucket: str) -> list[str]:
    pages = raw_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", ())]


@pytest.mark.usefixtures("credentials")
class TestBucketStore(StoreContract):
    @pytest.fixture
    def store(self, s3_endpoint):
        return Store.on_bucket(s3_endpoint, fresh_bucket(s3_endpoint))

    def reopen(self, store):
        backend = store.backend
        return Store.on_bucket(backend.endpoint, backend.bucket, prefix=backend.prefix)


@pytest.mark.usefixtures("credentials")
class TestBucketStoreUnderTheLongestPrefix(TestBucketStore):
    """The same contract with a 17-byte prefix: a 1000-byte name is a 1024-byte key."""

    @pytest.fixture
    def store(self, s3_endpoint, shared_bucket):
        prefix = "p" + secrets.token_hex(8)
        return Store.on_bucket(s3_endpoint, shared_bucket, prefix=prefix)


@pytest.fixture(scope="module")
def shared_bucket(s3_endpoint):
    return fresh_bucket(s3_endpoint)


# -- the server under the tests


def test_the_server_refuses_a_second_conditional_write(s3_endpoint):
    bucket = fresh_bucket(s3_endpoint)
    client = raw_client(s3_endpoint)
    client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(client.exceptions.ClientError) as caught:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"


# -- the layout


def test_objects_and_names_are_plain_keys_under_the_prefix(s3_endpoint, credentials):
    bucket = fresh_bucket(s3_endpoint)
    store = Store.on_bucket(s3_endpoint, bucket, prefix="team/fed/")
    digest = store.keep("run/é x/0", [1, 2])
    assert sorted(keys(s3_endpoint, bucket)) == [
        "team/fed/names/run/é x/0", f"team/fed/objects/{digest[7:]}"]
    assert store.backend.prefix == "team/fed"
    assert store.where == f"{s3_endpoint}/{bucket}/team/fed"
    assert Store.on_bucket(s3_endpoint, bucket).bound() == []


def test_listing_reads_every_page(s3_endpoint, credentials):
    store = Store.on_bucket(s3_endpoint, fresh_bucket(s3_endpoint))
    store.backend.page = 7  # S3's pages hold 1000 keys; seven makes many pages of few names
    digest = store.put(b"x")
    names = [f"many/{i:02d}" for i in range(40)] + ["many", "other/0"]
    for name in names:
        store.bind(name, digest, {"n": name})
    assert [b.name for b in store.bound("many")] == sorted(names[:-1])
    listed = store.bound()
    assert [b.name for b in listed] == sorted(names)
    assert all(b.meta == {"n": b.name} for b in listed)


# -- opening


def test_the_probe_leaves_nothing_behind(s3_endpoint, credentials):
    bucket = fresh_bucket(s3_endpoint)
    Store.on_bucket(s3_endpoint, bucket, prefix="x")
    Store.on_bucket(s3_endpoint, bucket)
    assert keys(s3_endpoint, bucket) == []


def test_an_endpoint_that_ignores_conditional_writes_is_refused(forgetful_endpoint,
                                                                s3_endpoint, credentials):
    bucket = fresh_bucket(s3_endpoint)
    through = BucketBackend(forgetful_endpoint, bucket)  # the proxy really forgets:
    record = b'{"digest":"x"}'
    assert through.claim_name("twice", record) and through.claim_name("twice", record)
    with pytest.raises(StoreError) as caught:
        Store.on_bucket(forgetful_endpoint, bucket)
    message = str(caught.value)
    assert forgetful_endpoint in message and repr(bucket) in message
    assert "second conditional write" in message and "every trial to every machine" in message
    assert keys(s3_endpoint, bucket) == ["names/twice"]  # the probe was cleaned up
    Store.on_bucket(s3_endpoint, bucket)  # the same bucket, asked directly, is fine


def test_a_claim_whose_answer_was_lost_is_still_won(lossy_endpoint, s3_endpoint, credentials):
    bucket = fresh_bucket(s3_endpoint)
    store = Store.on_bucket(lossy_endpoint, bucket)  # the probe's first write is lost too
    mine, theirs = store.put(b"mine"), store.put(b"theirs")
    # Written, the answer lost, sent again by botocore, refused as taken: by this claim.
    assert store.claim("round/1", mine, {"by": "me"}) is True
    assert store.claim("round/1", theirs) is False
    direct = Store.on_bucket(s3_endpoint, bucket)
    assert direct.claim("round/2", theirs, {"by": "them"}) is True
    assert store.claim("round/2", mine) is False  # nothing lost: plainly taken
    won = direct.resolve("round/1")
    assert (won.digest, won.meta) == (mine, {"by": "me"})


def test_an_endpoint_nobody_answers_is_refused_at_once(credentials):
    with socket_nobody_listens_on() as endpoint:
        began = time.monotonic()
        with pytest.raises(StoreError) as caught:
            Store.on_bucket(endpoint, "some-bucket")
    assert time.monotonic() - began < 10
    message = str(caught.value)
    assert endpoint in message and "'some-bucket'" in message and "server there is up" in message


def test_a_missing_bucket_is_refused_with_how_to_make_it(s3_endpoint, credentials):
    with pytest.raises(StoreError) as caught:
        Store.on_bucket(s3_endpoint, "never-made-bucket")
    message = str(caught.value)
    assert "'never-made-bucket' does not exist" in message and s3_endpoint in message
    assert "aws s3 mb s3://never-made-bucket" in message


def test_credentials_the_server_does_not_know_are_refused():
    # moto checks signatures only when told to; this server is told to from the start.
    with s3_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint, \
            pytest.raises(StoreError) as caught:
        Store.on_bucket(endpoint, "a-bucket", key="AKIANOBODY", secret="wrong")
    message = str(caught.value)
    assert endpoint in message and "'a-bucket'" in message
    assert "InvalidAccessKeyId" in message and "key= and secret=" in message


def test_credentials_come_from_arguments_or_from_the_environment(s3_endpoint, monkeypatch):
    bucket = fresh_bucket(s3_endpoint)
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                     "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match="no credentials.*AWS_ACCESS_KEY_ID"):
        Store.on_bucket(s3_endpoint, bucket)
    given = Store.on_bucket(s3_endpoint, bucket, key=KEY, secret=SECRET)
    given.keep("a", 1)
    assert pickle.loads(pickle.dumps(given)).recall("a") == 1  # the key travels with it
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert Store.on_bucket(s3_endpoint, bucket).recall("a") == 1
    assert SECRET not in repr(given) and SECRET not in given.where


@pytest.mark.parametrize("arguments, named", [
    (("127.0.0.1:9000", "bkt"), "endpoint '127.0.0.1:9000'"),
    (("ftp://host", "bkt"), "endpoint 'ftp://host'"),
    (("http://host:9000/bkt", "bkt"), "the bucket is a separate argument"),
    (("http://host", "a"), "bucket 'a'"),
    (("http://host", "with/slash"), "bucket 'with/slash'"),
    (("http://host", "bkt", {"prefix": "a//b"}), "empty part"),
    (("http://host", "bkt", {"prefix": "/abs"}), "starts with '/'"),
    (("http://host", "bkt", {"prefix": "p" * 18}), "at most 17"),
    (("http://host", "bkt", {"key": "k"}), "go together"),
    ((9000, "bkt"), "not a int"),
    (("http://host", "bkt", {"region": ""}), "region"),
], ids=lambda case: ascii(case)[:30])
def test_malformed_arguments_are_refused_before_anything_is_sent(arguments, named):
    *positional, how = arguments if isinstance(arguments[-1], dict) else (*arguments, {})
    with pytest.raises((BadName, TypeError), match=named.replace("(", r"\(")):
        Store.on_bucket(*positional, **how)


def test_hosted_puts_the_bucket_in_the_host_name(s3_endpoint):
    hosted = BucketBackend("https://s3.eu-west-3.amazonaws.com", "bkt", hosted=True,
                           region="eu-west-3", key=KEY, secret=SECRET)
    assert hosted.where == "https://bkt.s3.eu-west-3.amazonaws.com"
    request = hosted.client.generate_presigned_url(
        "get_object", Params={"Bucket": "bkt", "Key": "names/a"})
    assert request.startswith("https://bkt.s3.eu-west-3.amazonaws.com/names/a?")
    path = BucketBackend(s3_endpoint, "bkt", key=KEY, secret=SECRET)
    assert path.client.generate_presigned_url(
        "get_object", Params={"Bucket": "bkt", "Key": "names/a"}
    ).startswith(f"{s3_endpoint}/bkt/names/a?")


def test_without_boto3_the_store_says_which_extra_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["boto3"] = None  # as if it were not installed
        from somatize.store import Store
        try:
            Store.on_bucket("http://127.0.0.1:9", "bkt")
        except ImportError as exc:
            print(exc)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "needs boto3" in done.stdout and "pip install 'somatize[s3]'" in done.stdout


# -- processes


def contend(pickled: bytes, me: int, ready, go, answers) -> None:
    store = pickle.loads(pickled)  # a fresh connection in this process, as anywhere else
    digest = store.put(f"contender {me}".encode())
    store.resolve("warming/up")  # the connection is open before the race starts
    ready.release()
    go.wait()
    answers.put((me, digest, store.claim("round/7", digest, {"by": me})))


def test_32_processes_claiming_one_name_on_a_bucket_make_one_winner(s3_endpoint, credentials):
    store = Store.on_bucket(s3_endpoint, fresh_bucket(s3_endpoint))
    # Forked, so that 32 contenders do not spend ten seconds importing boto3 again.
    context = multiprocessing.get_context("fork")
    ready, go, answers = context.Semaphore(0), context.Event(), context.Queue()
    pickled = pickle.dumps(store)
    children = [context.Process(target=contend, args=(pickled, me, ready, go, answers))
                for me in range(32)]
    try:
        for child in children:
            child.start()
        for _ in children:
            assert ready.acquire(timeout=60), "the contenders did not all start"
        go.set()
        said = sorted(answers.get(timeout=60) for _ in children)
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    assert all(child.exitcode == 0 for child in children)
    winners = [(me, digest) for me, digest, won in said if won is True]
    assert len(winners) == 1, said
    assert sum(won is False for *_, won in said) == 31
    (me, digest), = winners
    bound = store.resolve("round/7")
    assert (bound.digest, bound.meta) == (digest, {"by": me})
    assert store.get(digest) == f"contender {me}".encode()


# -- helpers


class socket_nobody_listens_on:
    """An endpoint URL on a loopback port that is bound but never accepts."""

    def __enter__(self) -> str:
        import socket

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.socket.close()


# -- faults and bad bytes


def test_credentials_that_may_only_read_open_the_store_read_only(iam_endpoint):
    bucket = "archive-" + secrets.token_hex(4)
    writer = iam_endpoint.client("writer")
    writer.create_bucket(Bucket=bucket)
    key, secret = iam_endpoint.keys["writer"]
    Store.on_bucket(iam_endpoint.endpoint, bucket, key=key, secret=secret).keep("kept", [1])
    before = keys_of(writer, bucket)
    key, secret = iam_endpoint.keys["reader"]
    store = Store.on_bucket(iam_endpoint.endpoint, bucket, key=key, secret=secret)
    assert store.recall("kept") == [1] and [b.name for b in store.bound()] == ["kept"]
    for attempt in (lambda: store.keep("new", 2), lambda: store.put(b"x"),
                    lambda: store.claim("kept/2", store.resolve("kept").digest)):
        with pytest.raises(StoreError) as caught:
            attempt()
        message = str(caught.value)
        assert "read-only with these credentials" in message and "AccessDenied" in message
        assert "key=" in message and repr(bucket) in message
    with pytest.warns(UserWarning, match="read-only") as warned:
        recorder = Recorder(store, run="r")
        for _ in range(2):
            recorder({"fact": "began"})
            recorder({"fact": "finished", "took_us": 1})
        recorder.close()
    assert len(warned) == 1 and recorder.lost == 2
    assert pickle.loads(pickle.dumps(store)).recall("kept") == [1]
    assert keys_of(writer, bucket) == before
    with pytest.raises(StoreError, match="InvalidAccessKeyId"):  # unknown: refused at once
        Store.on_bucket(iam_endpoint.endpoint, bucket, key="AKIANOBODY", secret="wrong")


def test_a_record_that_cannot_be_read_is_left_out_of_a_bucket_listing(iam_endpoint):
    bucket = "records-" + secrets.token_hex(4)
    writer = iam_endpoint.client("writer")
    writer.create_bucket(Bucket=bucket)
    key, secret = iam_endpoint.keys["writer"]
    store = Store.on_bucket(iam_endpoint.endpoint, bucket, key=key, secret=secret)
    digest = store.put(b"x")
    for name in ("a", "hidden", "run/0", "run/1"):
        store.bind(name, digest)
    writer.put_object(Bucket=bucket, Key="names/run/1", Body=b'{"digest":')
    with pytest.warns(UserWarning, match="'run/1'") as warned:
        assert [b.name for b in store.bound()] == ["a", "hidden", "run/0"]
    assert len(warned) == 1
    key, secret = iam_endpoint.keys["reader"]
    reader = Store.on_bucket(iam_endpoint.endpoint, bucket, key=key, secret=secret)
    with pytest.warns(UserWarning) as warned:
        assert [b.name for b in reader.bound()] == ["a", "run/0"]
    message = str(warned[0].message)
    assert len(warned) == 1 and "'hidden'" in message and "AccessDenied" in message
    assert "'run/1'" in message


def test_put_heals_an_object_whose_bytes_in_the_bucket_are_corrupt(s3_endpoint, credentials):
    bucket = fresh_bucket(s3_endpoint)
    store = Store.on_bucket(s3_endpoint, bucket)
    data = os.urandom(1000)
    digest = store.put(data)
    raw_client(s3_endpoint).put_object(Bucket=bucket, Key=f"objects/{digest[7:]}",
                                      Body=data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObject, match=digest):
        store.get(digest)
    assert store.put(data) == digest
    assert store.get(digest) == data


def keys_of(client, bucket: str) -> dict[str, str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"]: item["ETag"] for page in pages for item in page.get("Contents", ())}
