import enum
import hashlib
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from somatize import Opaque, codec
from somatize._keys import Unwritable, digest_of, hexdigest_of, node_key, node_prefix


class Blob:
    def __init__(self, data: bytes):
        self.data = data


class Level(enum.IntEnum):
    HIGH = 3


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


# Keys name what was kept in every store already written: computed once by the encoder
# that fed the hash element by element, they must never change, however it is computed.
PINNED = [
    (7, "8c53dd6f61f8e28d4716aa9760a3e59a3d8b233c3c8bfdb3fdabead1e5250a9c"),
    (-2**100, "4ac87216eac0e0d476b5535a8906018a57342b58357bfb854191280735b0e562"),
    (0.1, "e4e1d9b6208a3452d02ebff6f274cd18eb80b8109233073e96311e755292abae"),
    (-0.0, "cc456bd05fe76b51e4fdefc2d6abd88943c4a5fab066b754967abe30b5fd753c"),
    ("héllo", "38c69b06c666de56c36766076d8265caa01873de290f50b4f0c7a6dee7d6ee06"),
    ("", "76ca65fa532efea2d73e4cb2775f96cfb650d5c8c9dbb78594a01f4cf8bb3bfe"),
    (b"\x00\x01", "176fba53c44a6ad68f36fc1a0bb4120e36f3cdae5e5370adabb571451c066d43"),
    (None, "8ce86a6ae65d3692e7305e2c58ac62eebd97d3d943e093f577da25c36988246b"),
    (True, "e632b7095b0bf32c260fa4c539e9fd7b852d0de454e9be26f24d0d6f91d069d3"),
    (False, "f67ab10ad4e4c53121b6a5fe4da9c10ddee905b978d3788d2723d7bfacbe28a9"),
    ({"values": list(range(5)), "name": "a", "pair": (1, 2.5, None), "flags": [True, False],
      "raw": b"xy", "deep": {"z": [[], (), {}]}},
     "20875dd116482ca25fdb636af9b4c30a7df7aa2added3bbe68e397790e50c446"),
    (list(range(100)), "d2b50ec5b41ce2e55820c1bbcbc38195288ad80ef1f08f3772e75623e4011d79"),
    ((1, "a", (b"b", [None])), "e0914e5ccd4b4d4f086e65f1567392bef622b97efbad3d72cb082895578c655c"),
    (Opaque([1, 2]), "55d9ec30bf03deeacc02a31792c9c531653ba09fef104f2dd4895e75b6d908cc"),
    ([i * 0.5 for i in range(50)],
     "c62351b9821beb2fd3a8ee0dd5196a56e18869912aa1940f9161f82009bac7b2"),
    ([str(i) for i in range(40)] + ["\udc80x"],
     "2e28fc62f2f3ebe0378354e4c0bad40342d7561b23b35ae19b88eddc88775c7c"),
    ([True, False] * 20,
     "854c841cfad36798a072de972bfb4f72b6521f1b62faed25aaa4c64fd14356da"),
    ([1, True, 2, False] * 10,
     "5b05fe5a28cdd19914896a8a23cc67d864f2d0b77629a7433b551aa5af94b473"),
    ([10**30 + i for i in range(20)] + [-5, -(10**20)],
     "60fc4d41024cad7526c811468ffae11d8855b50274c2513fb9f518a8d1e9bed5"),
    ((list(range(-300, 300, 7)), tuple(range(30))),
     "0b94df61521ee2e4647a0bc878405306b7ecdc5d1e8ddf899996e3f56e6fcb61"),
    ([b"ab" * i for i in range(20)],
     "48eccf37cb7aecceac6d9e2d03ebd733b4fec57f534850b622235df5b232d270"),
    ([[i, float(i), str(i)] for i in range(20)],
     "b955718d1a8c63b4002c88c5cbde95620485679a536c14e1d8c5a22d27ba07c0"),
    ([Level.HIGH, Level.HIGH],
     "ae1677e12dcdd3de47795ace09ab69096c5106307590459879fb88a999e19069"),
    (bytes(70000),
     "f4dcc12d0ef8173e583b1c7afe3db60479a9ba1c0586063683bf93570b5eaf28"),
    ({"big": bytes(range(256)) * 300, "small": [1, 2]},
     "7522e89d65d5c06b01d3b3cbdb91f0033884020f91d9bedcf3f83601e695a442"),
]


@pytest.mark.parametrize(("value", "key"), PINNED, ids=[repr(v)[:30] for v, _ in PINNED])
def test_keys_stay_what_they_were(value, key):
    assert digest_of(value).hex() == key


def _reference(update, value):
    """The encoding as first written, one hash update per piece: what keys are."""
    cls = type(value)
    if cls is str:
        raw = value.encode("utf-8", "surrogatepass")
        update(b"s" + len(raw).to_bytes(8, "little") + raw)
    elif cls is int:
        raw = str(value).encode()
        update(b"i" + len(raw).to_bytes(8, "little") + raw)
    elif cls is float:
        update(b"f" + struct.pack("<d", value))
    elif cls is bool:
        update(b"T" if value else b"F")
    elif value is None:
        update(b"N")
    elif cls is bytes:
        update(b"b" + len(value).to_bytes(8, "little") + value)
    elif cls is list or cls is tuple:
        update((b"l" if cls is list else b"t") + len(value).to_bytes(8, "little"))
        for item in value:
            _reference(update, item)
    else:
        update(b"d" + len(value).to_bytes(8, "little"))
        for key in sorted(value):
            _reference(update, key)
            _reference(update, value[key])


_scalars = (st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
            | st.booleans() | st.none())
_data = st.recursive(_scalars, lambda inner: st.lists(inner) | st.tuples(inner, inner)
                     | st.dictionaries(st.text(), inner) | st.lists(st.integers(), min_size=4)
                     | st.lists(st.floats(), min_size=4) | st.lists(st.text(), min_size=4),
                     max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(_data)
def test_the_encoding_is_the_one_keys_were_made_with(value):
    h = hashlib.sha256()
    _reference(h.update, value)
    assert digest_of(value) == h.digest()
