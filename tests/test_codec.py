import math

import pytest

from somatize import UnwritableError, codec, codecs_registered
from somatize._codec import dumps, loads, pack, unpack


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return (self.x, self.y) == (other.x, other.y)


def dump_point(p):
    return f"{p.x},{p.y}".encode()


def load_point(raw):
    x, y = raw.decode().split(",")
    return Point(int(x), int(y))


codec("test.codec.Point", Point, dump=dump_point, load=load_point)


def test_registration_is_harmless_again_and_refuses_clashes():
    codec("test.codec.Point", Point, dump=dump_point, load=load_point)
    assert codecs_registered()["test.codec.Point"] is Point

    class Other:
        pass

    with pytest.raises(ValueError, match="already registered for .*Point"):
        codec("test.codec.Point", Other, dump=bytes, load=bytes)
    with pytest.raises(ValueError, match="already has a codec under kind"):
        codec("test.codec.Point2", Point, dump=dump_point, load=load_point)
    with pytest.raises(TypeError, match="is data"):
        codec("test.codec.dict", dict, dump=bytes, load=bytes)
    assert "test.codec.Point2" not in codecs_registered()


def test_subclasses_use_the_nearest_codec():
    class Point3(Point):
        pass

    assert loads(dumps(Point3(1, 2))) == Point(1, 2)


def test_nested_values_round_trip():
    value = {"a": [1, 2.5, -0.0, float("inf")], "b": (b"raw", None, True), "p": Point(3, 4),
             "deep": {"list": [Point(1, 1), {"x": "y"}]}, "big": 2**80}
    again = loads(dumps(value))
    assert again == value
    assert math.copysign(1, again["a"][2]) == -1
    assert type(again["b"]) is tuple
    assert loads(dumps(float("nan"))) != loads(dumps(float("nan")))  # still a nan


def test_buffers_travel_beside_the_tree():
    tree, buffers = pack({"p": Point(1, 2), "raw": b"xyz"})
    assert buffers == [b"1,2", b"xyz"]
    assert unpack(tree, buffers) == {"p": Point(1, 2), "raw": b"xyz"}


def test_what_has_no_codec_is_refused_naming_its_type():
    with pytest.raises(UnwritableError, match="builtins.object has no codec"):
        dumps([object()])
    with pytest.raises(UnwritableError, match="only str keys"):
        dumps({1: 2})
    with pytest.raises(UnwritableError, match="reserved"):
        dumps({"__soma_opaque__": 1})


def test_an_unknown_kind_on_reading_names_it():
    blob = dumps(Point(1, 2)).replace(b"test.codec.Point", b"test.codec.Gone!")
    with pytest.raises(UnwritableError, match="test.codec.Gone!"):
        loads(blob)
    with pytest.raises(ValueError, match="bad magic"):
        loads(b"nope")
