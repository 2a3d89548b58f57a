"""What every Store must do, whatever keeps its bytes: one suite, seen only through the API.

A backend's test module subclasses ``StoreContract``, gives it a ``store`` fixture
(a fresh, empty Store) and a ``reopen(store)`` method (a second Store on the same
place), and must pass unchanged. Nothing here looks at files.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import time

import pytest

from somatize import BadName, StoreError, UnwritableError
from somatize.store import Bound, Store

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
ABSENT = "sha256:" + "0" * 64

BAD_DIGESTS = [
    "",
    "sha256:",
    "sha256:" + "a" * 63,
    "sha256:" + "a" * 65,
    "sha256:" + "A" * 64,
    "sha256:" + "g" * 64,
    "SHA256:" + "a" * 64,
    "md5:" + "a" * 32,
    "a" * 64,
    "sha256:" + "a" * 64 + "\n",
    " sha256:" + "a" * 64,
    b"sha256:" + b"a" * 64,
    None,
]

# (name, words the refusal must use to say which rule it broke)
BAD_NAMES = [
    ("", "empty"),
    ("/a", "starts with '/'"),
    ("/", "starts with '/'"),
    ("a//b", "empty part"),
    ("a/", "empty part"),
    (".", "'.'"),
    ("..", "'.'"),
    ("a/./b", "'.'"),
    ("a/../b", "'.'"),
    ("../a", "'.'"),
    ("a/..", "'.'"),
    ("a\x00b", "control character"),
    ("a\nb", "control character"),
    ("a\tb", "control character"),
    ("\x1f", "control character"),
    ("a\x7f", "control character"),
    ("a\\b", "backslash"),
    ("x" * 1001, "1001 bytes"),
    ("𝄞" * 251, "1004 bytes"),
    ("a\ud800b", "surrogate"),
]

# Names that are fine, chosen to trip layouts that are not one-to-one.
ODD_NAMES = [
    "a", "A", "a.n", "a.d", "a.c", "%41", "%2541", "a%2Fb", "a b", "...", ".hidden",
    "é", "e\u0301", "ﬁ", "fi", "日本/語", "x" * 1000, "𝄞" * 250, "/".join(["z"] * 500),
    "p" * 250 + "/q", "CON", "nul", "a~b", "a:b", "a*b?", "-", "_",
]


def bad_id(case: tuple[str, str]) -> str:
    return ascii(case[0])[:24]


class StoreContract:
    """The behaviour every Store shares. Subclasses give ``store`` and ``reopen``."""

    def reopen(self, store: Store) -> Store:
        raise NotImplementedError("a backend's suite says how to open its store a second time")

    # -- put and get

    def test_put_answers_the_sha256_of_the_bytes(self, store):
        digest = store.put(b"hello")
        assert digest == "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        assert DIGEST.fullmatch(digest)
        assert store.get(digest) == b"hello"
        assert type(store.get(digest)) is bytes

    def test_empty_and_binary_bytes_round_trip(self, store):
        data = bytes(range(256)) * 1000
        assert store.get(store.put(data)) == data
        assert store.get(store.put(b"")) == b""

    def test_bytearray_and_memoryview_are_taken_like_bytes(self, store):
        digest = store.put(b"same bytes")
        assert store.put(bytearray(b"same bytes")) == digest
        assert store.put(memoryview(b"xx same bytes xx")[3:-3]) == digest
        wide = memoryview(bytearray(b"abcdefgh")).cast("I")  # not a byte format
        assert store.get(store.put(wide)) == b"abcdefgh"

    def test_the_same_bytes_are_kept_once_under_one_digest(self, store):
        first = store.put(b"twice")
        again = store.put(b"twice")
        assert first == again
        assert store.get(first) == b"twice"
        assert store.put(b"twice!") != first

    def test_text_and_other_things_are_not_bytes(self, store):
        with pytest.raises(TypeError, match="encode"):
            store.put("text")
        with pytest.raises(TypeError, match="int"):
            store.put(12)

    def test_get_of_something_never_put_is_none(self, store):
        assert store.get(ABSENT) is None

    @pytest.mark.parametrize("digest", BAD_DIGESTS, ids=ascii)
    def test_a_malformed_digest_is_refused(self, store, digest):
        data = store.put(b"x")
        for attempt in (lambda: store.get(digest), lambda: store.bind("n", digest),
                        lambda: store.claim("n", digest)):
            with pytest.raises(BadName, match="sha256:' and 64 lowercase hex"):
                attempt()
        assert store.resolve("n") is None
        assert store.get(data) == b"x"

    # -- bind, claim, resolve

    def test_bind_then_resolve(self, store):
        digest = store.put(b"v1")
        before = time.time()
        assert store.bind("run/a/0", digest, {"step": 0}) is None
        after = time.time()
        bound = store.resolve("run/a/0")
        assert bound == Bound("run/a/0", digest, {"step": 0}, bound.when)
        assert type(bound.when) is float
        assert before - 1 <= bound.when <= after + 1

    def test_bound_is_a_frozen_dataclass_of_name_digest_meta_when(self, store):
        store.bind("n", store.put(b"x"))
        bound = store.resolve("n")
        assert [f.name for f in dataclasses.fields(Bound)] == ["name", "digest", "meta", "when"]
        assert bound.meta == {}
        with pytest.raises(dataclasses.FrozenInstanceError):
            bound.name = "m"  # type: ignore[misc]
        assert hash(bound) == hash(dataclasses.replace(bound, meta={"other": 1}))

    def test_resolve_of_an_unbound_name_is_none(self, store):
        assert store.resolve("never/bound") is None

    def test_bind_replaces_the_earlier_binding(self, store):
        first, second = store.put(b"1"), store.put(b"2")
        store.bind("n", first, {"v": 1})
        store.bind("n", second, {"v": 2})
        bound = store.resolve("n")
        assert (bound.digest, bound.meta) == (second, {"v": 2})
        assert [b.name for b in store.bound()] == ["n"]

    def test_meta_keeps_the_order_it_was_given_in(self, store):
        meta = {"zeta": 1, "alpha": {"y": [1, 2.5, None], "b": True}, "mid": "é", "nan": 0.5}
        store.bind("n", store.put(b"x"), meta)
        kept = store.resolve("n").meta
        assert kept == meta
        assert list(kept) == ["zeta", "alpha", "mid", "nan"]
        assert list(kept["alpha"]) == ["y", "b"]
        assert list(store.bound()[0].meta) == list(meta)

    def test_meta_is_copied_not_shared(self, store):
        meta = {"a": [1]}
        store.bind("n", store.put(b"x"), meta)
        meta["a"].append(2)
        got = store.resolve("n").meta
        got["b"] = 3
        assert store.resolve("n").meta == {"a": [1]}

    def test_meta_with_nan_and_big_numbers_reads_back(self, store):
        store.bind("n", store.put(b"x"), {"loss": float("nan"), "big": 2**100, "neg": -0.0})
        meta = store.resolve("n").meta
        assert math.isnan(meta["loss"]) and meta["big"] == 2**100
        assert math.copysign(1, meta["neg"]) == -1

    @pytest.mark.parametrize("meta, named", [
        ([("a", 1)], "list"),
        ({1: "a"}, "1"),
        ({"a": (1, 2)}, "meta['a'] is a tuple"),
        ({"a": {"b": {3}}}, "meta['a']['b'] is a set"),
        ({"a": [1, b"x"]}, "meta['a'][1] is a bytes"),
        ({"a": {2: 1}}, "2"),
        ({"a": object()}, "object"),
    ], ids=["not-a-dict", "int-key", "tuple", "set", "bytes", "nested-int-key", "object"])
    def test_meta_that_is_not_json_data_is_refused(self, store, meta, named):
        digest = store.put(b"x")
        named = re.escape(named)
        with pytest.raises(TypeError, match=named):
            store.bind("n", digest, meta)
        with pytest.raises(TypeError, match=named):
            store.claim("n", digest, meta)
        with pytest.raises(TypeError, match=named):
            store.keep("n", 1, meta)
        assert store.resolve("n") is None

    def test_claim_binds_only_the_first_time(self, store):
        first, second = store.put(b"first"), store.put(b"second")
        assert store.claim("round/1", first, {"by": "a"}) is True
        assert store.claim("round/1", second, {"by": "b"}) is False
        assert store.claim("round/1", first) is False
        bound = store.resolve("round/1")
        assert (bound.digest, bound.meta) == (first, {"by": "a"})

    def test_claim_loses_to_bind_and_bind_overrides_claim(self, store):
        first, second = store.put(b"first"), store.put(b"second")
        store.bind("n", first)
        assert store.claim("n", second) is False
        assert store.claim("m", first) is True
        store.bind("m", second)
        assert store.resolve("m").digest == second

    def test_binding_to_an_object_the_store_lacks_is_refused(self, store):
        for attempt in (store.bind, store.claim):
            with pytest.raises(StoreError) as caught:
                attempt("orphan/name", ABSENT)
            assert "'orphan/name'" in str(caught.value) and ABSENT in str(caught.value)
            assert "put()" in str(caught.value)
        assert store.resolve("orphan/name") is None
        assert store.claim("orphan/name", store.put(b"now")) is True

    def test_a_name_and_names_below_it_live_side_by_side(self, store):
        one, two, three = store.put(b"1"), store.put(b"2"), store.put(b"3")
        store.bind("a", one)
        store.bind("a/b", two)
        store.bind("a/b/c", three)
        assert [store.resolve(n).digest for n in ("a", "a/b", "a/b/c")] == [one, two, three]
        assert store.resolve("a/c") is None and store.resolve("b") is None

    @pytest.mark.parametrize("bad", BAD_NAMES, ids=bad_id)
    def test_a_malformed_name_is_refused_everywhere(self, store, bad):
        name, rule = bad
        digest = store.put(b"x")
        attempts = [lambda: store.bind(name, digest), lambda: store.claim(name, digest),
                    lambda: store.resolve(name), lambda: store.keep(name, 1),
                    lambda: store.recall(name), lambda: store.bound(name)]
        for attempt in attempts:
            with pytest.raises(BadName) as caught:
                attempt()
            message = str(caught.value)
            assert rule in message
            assert repr(name)[:40] in message
        assert store.bound() == []

    def test_names_that_are_not_str_are_refused(self, store):
        digest = store.put(b"x")
        for name in (None, b"a", 3, ["a"]):
            with pytest.raises(BadName, match="is a str, not"):
                store.bind(name, digest)
            with pytest.raises(BadName, match="is a str, not"):
                store.resolve(name)

    def test_names_that_look_alike_are_still_different_names(self, store):
        digests = {}
        for name in ODD_NAMES:
            digests[name] = store.put(name.encode())
            store.bind(name, digests[name])
        for name in ODD_NAMES:
            assert store.resolve(name).digest == digests[name], name
        listed = store.bound()
        assert [b.name for b in listed] == sorted(ODD_NAMES)
        assert all(b.digest == digests[b.name] for b in listed)
        assert store.resolve("a.n/x") is None and store.resolve("x" * 999) is None

    # -- listing

    def test_bound_lists_every_name_sorted(self, store):
        digest = store.put(b"x")
        names = ["run/b/1", "run/a/10", "zed", "run/a/2", "run/a", "alpha", "run/a-b"]
        for at, name in enumerate(names):
            store.bind(name, digest, {"at": at})
        listed = store.bound()
        assert [b.name for b in listed] == sorted(names)
        assert all(isinstance(b, Bound) and b.digest == digest for b in listed)
        assert {b.name: b.meta["at"] for b in listed} == {n: i for i, n in enumerate(names)}
        assert store.resolve("run/a/2") in listed

    def test_bound_of_an_empty_store_is_empty(self, store):
        assert store.bound() == []
        assert store.bound("run") == []

    def test_a_prefix_reaches_the_name_itself_and_what_is_below_it(self, store):
        digest = store.put(b"x")
        for name in ["run/a", "run/a/0", "run/a/1", "run/a/1/x", "run/ab/0", "run/a-b",
                     "run/b/0", "run", "runs/a/0"]:
            store.bind(name, digest)
        assert [b.name for b in store.bound("run/a")] == ["run/a", "run/a/0", "run/a/1",
                                                         "run/a/1/x"]
        assert [b.name for b in store.bound("run/a/1")] == ["run/a/1", "run/a/1/x"]
        assert [b.name for b in store.bound("run/ab")] == ["run/ab/0"]
        assert len(store.bound("run")) == 8
        assert store.bound("run/c") == [] and store.bound("ru") == []

    def test_a_prefix_with_nothing_at_it_still_reaches_below(self, store):
        store.bind("x/y/z", store.put(b"x"))
        assert [b.name for b in store.bound("x")] == ["x/y/z"]
        assert [b.name for b in store.bound("x/y")] == ["x/y/z"]

    # -- keep and recall

    def test_keep_and_recall_nested_data(self, store):
        value = {
            "list": [1, 2, [3, "four"]],
            "tuple": (1, ("nested", b"bytes"), []),
            "bytes": b"\x00\xff" * 100,
            "floats": [0.1, -0.0, float("inf"), -float("inf"), 1e308],
            "big": 2**200 + 1,
            "neg": -(2**90),
            "none": None,
            "bools": [True, False],
            "text": "héllo 𝄞",
            "empty": {},
        }
        digest = store.keep("values/one", value, {"why": "test"})
        assert DIGEST.fullmatch(digest)
        assert store.resolve("values/one").digest == digest
        assert store.resolve("values/one").meta == {"why": "test"}
        back = store.recall("values/one")
        assert back == value
        assert type(back["tuple"]) is tuple and type(back["tuple"][1]) is tuple
        assert math.copysign(1.0, back["floats"][1]) == -1.0
        assert list(back) == list(value)

    def test_keep_and_recall_nan(self, store):
        store.keep("nan", [float("nan")])
        (back,) = store.recall("nan")
        assert math.isnan(back)

    def test_keep_of_the_same_value_answers_the_same_digest(self, store):
        assert store.keep("a", {"x": [1, 2]}) == store.keep("b", {"x": [1, 2]})
        assert store.keep("c", {"x": [1, 3]}) != store.keep("a", {"x": [1, 2]})

    def test_keep_rebinds(self, store):
        store.keep("k", 1)
        store.keep("k", "two")
        assert store.recall("k") == "two"

    def test_recall_of_an_unbound_name_is_none(self, store):
        assert store.recall("nothing/here") is None

    def test_recall_of_raw_bytes_is_refused_with_a_way_out(self, store):
        digest = store.put(b"raw, not kept")
        store.bind("raw", digest)
        with pytest.raises(StoreError, match="get"):
            store.recall("raw")

    def test_keep_of_something_without_a_codec_writes_nothing(self, store):
        class NoCodec:
            pass

        with pytest.raises(UnwritableError, match="NoCodec"):
            store.keep("k", {"inside": [NoCodec()]})
        assert store.resolve("k") is None
        assert store.bound() == []

    # -- sharing

    def test_two_stores_on_one_place_see_each_others_names(self, store):
        other = self.reopen(store)
        assert other is not store and other.where == store.where
        digest = store.keep("from/first", {"n": 1})
        assert other.recall("from/first") == {"n": 1}
        assert other.resolve("from/first").digest == digest
        other.keep("from/second", [2])
        assert store.recall("from/second") == [2]
        assert store.claim("claimed", other.put(b"mine")) is True
        assert other.claim("claimed", other.put(b"theirs")) is False
        assert store.get(other.put(b"object")) == b"object"
        assert [b.name for b in other.bound()] == [b.name for b in store.bound()]

    def test_a_store_pickles_as_where_it_is(self, store):
        store.keep("before", 1)
        copy = pickle.loads(pickle.dumps(store))
        assert type(copy) is Store and copy.where == store.where and repr(copy) == repr(store)
        assert copy.recall("before") == 1
        copy.keep("after", 2)
        assert store.recall("after") == 2

    def test_where_and_repr_say_what_it_is(self, store):
        assert isinstance(store.where, str) and store.where
        assert repr(store).startswith("Store")
        assert store.where in repr(store) or "over" in repr(store)
