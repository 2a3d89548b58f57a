import hashlib
import math

import pytest

from somatize import Opaque, codec
from somatize._keys import Unwritable, digest_of, hexdigest_of, node_key, node_prefix


class Blob:
    def __init__(self, data: bytes):
        self.data = data


codec("test.keys.Blob", Blob, dump=lambda b: b.data, load=Blob)


def test_types_are_told_apart():
    values = [1, 1.0, True, "1", b"1", [1], (1,), {"1": 1}, None, 0, False, 0.0, -0.0, ""]
    digests = [digest_of(v) for v in values]
    assert len(set(digests)) == len(values)


def test_dict_order_does_not_matter_but_content_does():
    assert digest_of({"a": 1, "b": [2, 3]}) == digest_of({"b": [2, 3], "a": 1})
    assert digest_of({"a": 1}) != digest_of({"a": 2})
    assert digest_of([1, 2]) != digest_of([2, 1])


def test_floats_are_bit_exact():
    assert digest_of(0.1 + 0.2) != digest_of(0.3)
    assert digest_of(float("nan")) == digest_of(float("nan"))
    assert digest_of(math.inf) != digest_of(-math.inf)


def test_structure_is_unambiguous():
    assert digest_of(["ab", "c"]) != digest_of(["a", "bc"])
    assert digest_of([[1], 2]) != digest_of([1, [2]])
    assert digest_of(2**100) != digest_of(2**100 + 1)


def test_opaque_by_codec_kind_and_digest():
    assert digest_of(Opaque(Blob(b"x"))) == digest_of(Opaque(Blob(b"x")))
    assert digest_of(Opaque(Blob(b"x"))) != digest_of(Opaque(Blob(b"y")))
    assert digest_of(Opaque(Blob(b"x"))) != digest_of(b"x")
    # an Opaque of data names the data: the node below sees the same value either way
    assert digest_of(Opaque([1, 2])) == digest_of([1, 2])


def test_what_cannot_be_written_down_says_its_type():
    with pytest.raises(Unwritable) as caught:
        digest_of([1, object()])
    assert caught.value.what is object
    with pytest.raises(Unwritable):
        digest_of({1: "int key"})


def test_bytes_are_hashed_where_they_lie():
    data = bytes(range(256)) * 1000
    expected = hashlib.sha256(b"b" + len(data).to_bytes(8, "little") + data).digest()
    assert digest_of(data) == expected
    assert digest_of(memoryview(data)) == expected == digest_of(bytearray(data))
    assert hexdigest_of(data) == "sha256:" + expected.hex()


def test_node_keys_depend_on_every_part():
    base = node_prefix("m.Body", "sha256:decl", None, None)
    key = node_key(base, [b"input"])
    assert key == node_key(node_prefix("m.Body", "sha256:decl", None, None), [b"input"])
    others = [
        node_key(node_prefix("m.Head", "sha256:decl", None, None), [b"input"]),
        node_key(node_prefix("m.Body", "sha256:other", None, None), [b"input"]),
        node_key(node_prefix("m.Body", "sha256:decl", "salt", None), [b"input"]),
        node_key(node_prefix("m.Body", "sha256:decl", None, "sha256:w"), [b"input"]),
        node_key(base, [b"other"]),
        node_key(base, [b"input", b"input"]),
    ]
    assert key not in others and len(set(others)) == len(others)
