"""The bucket backend: a Store's objects and names as keys in an S3 bucket.

For a cluster with no directory every machine mounts: AWS S3, MinIO, R2, Ceph, or
anything else that speaks S3 and honours conditional writes. The layout is the
directory store's, with keys instead of files (``prefix`` is optional)::

    <prefix>/objects/<hex>      the bytes of one object, under their sha256
    <prefix>/names/<name>       one name's record (a small JSON document)

A name is at most 1000 bytes, so its key stays under S3's 1024 with a prefix of up to
17 bytes; a longer prefix is refused rather than leaving some names unwritable. A PUT
replaces an object whole, so readers never see half of one. ``claim_name`` is a PUT
with ``If-None-Match: *``: the server lets exactly one through and answers the others
412. An endpoint that ignores the header would let everybody through and nobody would
notice, which is why ``BucketBackend.opened`` writes one key twice before answering.
Credentials that may read but not write (the server answers that probe 403
AccessDenied) open the store read-only: reading works, and every write is refused,
saying so, without asking the server.

boto3 is imported here and nowhere else, so the core runs without it. The client is
made on first use, so the backend pickles as its address (and the key and secret, if
they were given as arguments; credentials read from the environment are read again
wherever it is unpickled) and reconnects in the process that unpickled it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

try:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        NoCredentialsError,
        PartialCredentialsError,
    )
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError(
        "a store on a bucket needs boto3, which is not installed; install the s3 extra: "
        "pip install 'somatize[s3]'"
    ) from missing

from .._errors import BadName, StoreError
from ._store import MAX_NAME, check_name

__all__ = ["BucketBackend"]

_MAX_KEY = 1024  # bytes of UTF-8, S3's limit
_LONGEST_PREFIX = _MAX_KEY - len("names/") - MAX_NAME - 1  # 17; the 1 is its "/"
_ATTEMPTS = 8  # botocore's standard mode: backoff on 5xx, throttling and dropped connections
_CONFLICTS = 10  # 409s in a row on one claim before it is reported
_READERS = 16  # records fetched at once by a listing
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]").fullmatch
_MD5 = re.compile(r"[0-9a-f]{32}").fullmatch
_SHARED: dict[str, Any] = {}  # one boto3 session per process: a client costs ms, not 0.1 s
_SHARING = threading.Lock()
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
           "InvalidToken", "ExpiredToken", "InvalidSecurity"}


def _unlock_after_fork() -> None:
    # A child must not inherit a lock that some other thread of its parent held. The
    # session itself holds no connection (clients do), so it is kept.
    global _SHARING
    _SHARING = threading.Lock()


os.register_at_fork(after_in_child=_unlock_after_fork)


class _Missing(Exception):
    """The key is not there (404)."""


class _Taken(Exception):
    """A conditional write found the key there (412). ``retried``: botocore had sent it
    more than once, so the write that made the key there may have been this one."""

    def __init__(self, retried: bool):
        super().__init__()
        self.retried = retried

    def __reduce__(self) -> tuple[Any, ...]:
        return _Taken, (self.retried,)


class _Conflict(Exception):
    """Another conditional write to the key was in flight (409); worth asking again."""


class _Denied(StoreError):
    """The server refused these credentials the request (403 and its kin); ``code`` says
    how."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class BucketBackend:
    """Objects and names as keys in one S3 bucket (see the module's docstring).

    Constructing one talks to nobody; ``opened`` is the same, checked against the
    endpoint. ``hosted=True`` puts the bucket in the host name (virtual-hosted, which
    AWS prefers); the default puts it in the path, which MinIO and moto expect.
    Without ``key``/``secret`` the credentials are boto3's usual ones: the
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` variables first.
    """

    #: Keys asked for per listing request; S3 answers at most 1000.
    page = 1000

    def __init__(self, endpoint: str, bucket: str, *, region: str = "us-east-1",
                 key: str | None = None, secret: str | None = None, hosted: bool = False,
                 prefix: str = ""):
        self.endpoint = _endpoint(endpoint)
        self.bucket = _bucket(bucket)
        if type(region) is not str:
            raise TypeError(f"region is a str such as 'us-east-1', not a "
                            f"{type(region).__qualname__}")
        if not region.strip():
            raise BadName("region '' is refused: name the bucket's region, such as "
                          "'us-east-1' (the default; most servers that are not AWS ignore it)")
        if (key is None) != (secret is None) or not all(
                v is None or type(v) is str for v in (key, secret)):
            raise TypeError("key= and secret= go together, both str: give both, or neither "
                            "to read AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        self.region, self.hosted, self.prefix = region, bool(hosted), _prefix(prefix)
        self._key, self._secret = key, secret
        self._base = self.prefix + "/" if self.prefix else ""
        scheme, host = self.endpoint.split("://", 1)
        place = (f"{scheme}://{self.bucket}.{host}" if self.hosted
                 else f"{self.endpoint}/{self.bucket}")
        self.where = f"{place}/{self.prefix}" if self.prefix else place
        self._client: Any = None
        self._lock = threading.Lock()
        self._read_only: str | None = None  # what the server said to the probe's write

    @classmethod
    def opened(cls, endpoint: str, bucket: str, **how: Any) -> BucketBackend:
        """A backend on this bucket, once the endpoint has shown it can be one."""
        backend = cls(endpoint, bucket, **how)
        backend.probe()
        return backend

    def __repr__(self) -> str:
        extra = "".join([f", region={self.region!r}" if self.region != "us-east-1" else "",
                         ", hosted=True" if self.hosted else "",
                         f", prefix={self.prefix!r}" if self.prefix else ""])
        return f"BucketBackend({self.endpoint!r}, {self.bucket!r}{extra})"

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items()
                if name not in ("_client", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._client, self._lock = None, threading.Lock()

    # -- objects

    def object_at(self, hexdigest: str) -> str:
        return f"{self.where}/objects/{hexdigest}"

    def has_object(self, hexdigest: str) -> bool:
        try:
            self._request("look for", self._object(hexdigest), "head_object")
        except _Missing:
            return False
        return True

    def read_object(self, hexdigest: str) -> bytes | None:
        return self._read(self._object(hexdigest))

    def holds(self, hexdigest: str, data: memoryview) -> bool:
        """Whether the object kept under this digest is exactly ``data``, asked of the
        server: its size, then its ETag, the MD5 of what a plain PUT stored. Where the
        ETag is no MD5 (a multipart upload), the bytes are fetched and compared; where
        it is one but not of these bytes (a key encrypted with KMS), the object is
        written again, which is wasted but never wrong. ``get`` checks the sha256
        whatever this says."""
        key = self._object(hexdigest)
        try:
            head = self._request("look for", key, "head_object")
        except _Missing:
            return False
        if head.get("ContentLength") != data.nbytes:
            return False
        tag = str(head.get("ETag", "")).strip('"')
        if _MD5(tag):
            return tag == hashlib.md5(data, usedforsecurity=False).hexdigest()
        return self._read(key) == data.tobytes()

    def write_object(self, hexdigest: str, data: memoryview) -> None:
        self._writable("write", self._object(hexdigest))
        self._request("write", self._object(hexdigest), "put_object", Body=_bytes(data))

    # -- names

    def read_name(self, name: str) -> bytes | None:
        return self._read(self._name(name))

    def write_name(self, name: str, record: bytes) -> None:
        self._writable("bind", self._name(name))
        self._request("bind", self._name(name), "put_object", Body=record)

    def claim_name(self, name: str, record: bytes) -> bool:
        self._writable("claim", self._name(name))
        return self._put_if_absent("claim", self._name(name), record)

    def list_names(self, prefix: str | None) -> list[tuple[str, bytes | StoreError]]:
        """Every record under names/; one these credentials may not read comes as the
        ``StoreError`` that says so, in place of its bytes."""
        start = self._base + "names/"
        keys = self._keys(start if prefix is None else f"{start}{prefix}/")
        if prefix is not None:
            keys.insert(0, start + prefix)
        if len(keys) < 2:
            records = [self._read(key) for key in keys]
        else:
            with ThreadPoolExecutor(min(_READERS, len(keys))) as pool:
                records = list(pool.map(self._read_listed, keys))  # None: unbound since listed
        skip = len(start)
        return [(key[skip:], record) for key, record in zip(keys, records) if record is not None]

    # -- the endpoint

    def probe(self) -> None:
        """Writes a fresh key twice with ``If-None-Match: *``, and refuses an endpoint
        that takes the second: ``claim`` would then hand every trial to every machine.

        Asked with few retries, so an endpoint that is not there says so at once
        rather than after a minute of backing off. Also what finds a missing bucket or
        credentials that do not work, before anything else is tried.
        """
        key = f"{self._base}tmp/probe-{os.getpid()}-{secrets.token_hex(8)}"
        client = self._connect(attempts=2)
        try:
            try:
                first = self._put_if_absent("write a probe", key, b"first", client)
            except _Denied as denied:
                if denied.code not in ("AccessDenied", "403"):
                    raise  # credentials the server does not know at all
                self._read_only = str(denied)
                return
            if not first:
                raise StoreError(
                    f"{self.endpoint} refused a conditional write to {key!r}, a key nobody "
                    f"could have written, in bucket {self.bucket!r}; it does not handle "
                    "If-None-Match: * correctly, and claim needs it — use another endpoint")
            honoured = not self._put_if_absent("write a probe again", key, b"second", client)
        finally:
            self._discard(key, client)
        if not honoured:
            raise StoreError(
                f"{self.endpoint} accepted a second conditional write (If-None-Match: *) to "
                f"{key!r} in bucket {self.bucket!r}: it ignores the condition, so claim "
                "would hand every trial to every machine. Use a server that honours it (AWS "
                "S3, MinIO since 2024, R2, moto 5), or a Store on a shared directory"
            )

    def _put_if_absent(self, action: str, key: str, body: bytes, client: Any = None) -> bool:
        """Writes ``body`` under ``key`` only if nothing is there; True if this call did."""
        for attempt in range(_CONFLICTS):
            try:
                self._request(action, key, "put_object", Body=body, IfNoneMatch="*",
                              client=client)
                return True
            except _Taken as taken:
                # A retried write may have been ours, its answer lost on the way back;
                # the body is this call's alone (a record holds its time), so it tells.
                return taken.retried and self._read(key, client) == body
            except _Conflict:  # another conditional write to it was in flight: ask again
                time.sleep(0.01 * 2 ** attempt * (1 + secrets.randbelow(100) / 100))
        raise StoreError(
            f"could not {action} {key!r} in bucket {self.bucket!r}: {self.endpoint} answered "
            f"409 ConditionalRequestConflict {_CONFLICTS} times in a row; something is "
            "writing that key in a loop — find it, then try again"
        )

    def _read(self, key: str, client: Any = None) -> bytes | None:
        try:
            return self._request("read", key, "get_object", body=True, client=client)
        except _Missing:
            return None

    def _read_listed(self, key: str) -> bytes | StoreError | None:
        try:
            return self._read(key)
        except _Denied as denied:
            if denied.code not in ("AccessDenied", "403"):
                raise
            return denied

    def _writable(self, action: str, key: str) -> None:
        if self._read_only is not None:
            raise StoreError(
                f"cannot {action} {key!r}: the store at {self.where} is read-only with these "
                f"credentials, since the server refused the write asked of it when the store "
                f"was opened ({self._read_only}); reading it works — to write, pass key= and "
                f"secret= (or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) for a key that "
                f"may write bucket {self.bucket!r}")

    def _discard(self, key: str, client: Any) -> None:
        try:
            client.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError):
            pass  # a stray probe under tmp/ is never read; refusing the store for it is worse

    def _connect(self, attempts: int = _ATTEMPTS) -> Any:
        config = Config(
            region_name=self.region,
            s3={"addressing_style": "virtual" if self.hosted else "path"},
            retries={"mode": "standard", "max_attempts": attempts},
            connect_timeout=10, read_timeout=60, max_pool_connections=_READERS,
            # Checksums only where S3 demands them: servers that are not AWS refuse the
            # newer default headers, and the Store checks every object's sha256 anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        with _SHARING:  # making clients from one session is not safe from two threads
            session = _SHARED.get("session")
            if session is None:
                session = _SHARED["session"] = boto3.session.Session()
            return session.client("s3", endpoint_url=self.endpoint, config=config,
                                  **self._credentials())

    def _credentials(self) -> dict[str, str]:
        """The key given, else the one in the environment now, else boto3's own search
        (profiles, instance roles), which the session remembers once found."""
        if self._key is not None:
            return {"aws_access_key_id": self._key, "aws_secret_access_key": self._secret}
        key = os.environ.get("AWS_ACCESS_KEY_ID")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not (key and secret):
            return {}
        found = {"aws_access_key_id": key, "aws_secret_access_key": secret}
        if os.environ.get("AWS_SESSION_TOKEN"):
            found["aws_session_token"] = os.environ["AWS_SESSION_TOKEN"]
        return found

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use in this process."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _request(self, action: str, key: str, operation: str, *, body: bool = False,
                 client: Any = None, **params: Any) -> Any:
        """One call to the endpoint, its failures turned into ours: a missing key, a
        taken one and a conflict for the caller to decide on; the rest ``StoreError``."""
        call = getattr(client or self.client, operation)
        try:
            answer = call(Bucket=self.bucket, Key=key, **params)
            return answer["Body"].read() if body else answer
        except ClientError as exc:
            error, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
            code, status = str(error.get("Code", "")), meta.get("HTTPStatusCode")
            if code in ("NoSuchKey", "NotFound") or (code == "404"
                                                      and operation == "head_object"):
                raise _Missing from None
            if status == 412 or code == "PreconditionFailed":
                raise _Taken(meta.get("RetryAttempts", 0) > 0) from None
            if status == 409 and code in ("ConditionalRequestConflict", "OperationAborted"):
                raise _Conflict from None
            raise self._refused(action, key, code, status, error.get("Message", "")) from exc
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StoreError(
                f"no credentials to {action} {key!r} in bucket {self.bucket!r} at "
                f"{self.endpoint}: pass key= and secret=, or set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY"
            ) from exc
        except BotoCoreError as exc:
            raise StoreError(
                f"could not {action} {key!r} in bucket {self.bucket!r}: {exc}; check that "
                f"{self.endpoint} is the right address and that the server there is up"
            ) from exc

    def _refused(self, action: str, key: str, code: str, status: Any,
                 message: str) -> StoreError:
        said = f"{status} {code}" + (f" ({message})" if message else "")
        if code == "NoSuchBucket":
            return StoreError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint} (asked to {action} "
                f"{key!r}); create it first (aws s3 mb s3://{self.bucket} --endpoint-url "
                f"{self.endpoint}), or name one that exists"
            )
        if code in _DENIED:
            return _Denied(
                f"{self.endpoint} refused to let us {action} {key!r} in bucket "
                f"{self.bucket!r}: {said}; pass key= and secret= (or set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) for a key that may list, read "
                "and write that bucket (without list, S3 answers 403 for a missing key)",
                code)
        return StoreError(f"{self.endpoint} answered {said} when asked to {action} {key!r} "
                          f"in bucket {self.bucket!r}")

    # -- keys

    def _object(self, hexdigest: str) -> str:
        return f"{self._base}objects/{hexdigest}"

    def _name(self, name: str) -> str:
        return f"{self._base}names/{name}"

    def _keys(self, start: str) -> list[str]:
        """Every key that begins with ``start``, across as many pages as it takes."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start, PaginationConfig={"PageSize": self.page})
        try:
            return [item["Key"] for page in pages for item in page.get("Contents", ())]
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise self._refused("list", start, str(error.get("Code", "")),
                                exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                                error.get("Message", "")) from exc
        except BotoCoreError as exc:
            raise StoreError(f"could not list {start!r} in bucket {self.bucket!r}: {exc}; "
                             f"check that {self.endpoint} is up") from exc


def _bytes(data: memoryview) -> bytes:
    whole = data.obj
    if type(whole) is bytes and len(whole) == data.nbytes:
        return whole
    return data.tobytes()


def _endpoint(endpoint: Any) -> str:
    if type(endpoint) is not str:
        raise TypeError(f"endpoint is a URL str such as 'http://127.0.0.1:9000', not a "
                        f"{type(endpoint).__qualname__}")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or \
            parts.fragment or parts.path.strip("/"):
        raise BadName(
            f"endpoint {endpoint!r} is refused: it is the server's URL, scheme and host "
            "and nothing after them, such as 'https://s3.us-east-1.amazonaws.com' or "
            "'http://127.0.0.1:9000'; the bucket is a separate argument"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _bucket(bucket: Any) -> str:
    if type(bucket) is not str:
        raise TypeError(f"bucket is a str, not a {type(bucket).__qualname__}")
    if not _BUCKET(bucket):
        raise BadName(
            f"bucket {bucket!r} is refused: a bucket name is 3 to 255 letters, digits, "
            "'.', '-' or '_', beginning and ending with a letter or digit (AWS asks for "
            "3 to 63, lowercase); to keep a store under a path inside it, use prefix="
        )
    return bucket


def _prefix(prefix: Any) -> str:
    if type(prefix) is not str:
        raise TypeError(f"prefix is a str, not a {type(prefix).__qualname__}")
    prefix = prefix.removesuffix("/")
    if not prefix:
        return ""
    check_name(prefix, "prefix")
    size = len(prefix.encode())
    if size > _LONGEST_PREFIX:
        raise BadName(
            f"prefix {prefix!r} is {size} bytes of UTF-8; at most {_LONGEST_PREFIX} fit, "
            f"since a name of up to {MAX_NAME} bytes under it has to stay within S3's "
            f"{_MAX_KEY}-byte keys — shorten it, or use a bucket of its own"
        )
    return prefix
