"""fedavg against Flower and against arithmetic done by hand; gather with real client
processes that share a folder or a bucket, some of which are killed on purpose; and
what a round does with its parts (a robust rule, a server optimizer carried by the
store, a quorum), with threads and processes on a real directory."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from fedrounds import gathered, keep_as, trained, weights

import somatize
from somatize import BadName, DeclarationError
from somatize._codec import dumps
from somatize.store import Store
from somatize.torch import ClientPrivacy, FedAdam, FedAvgM, fedavg, fedmedian, gather, krum

SRC = str(Path(somatize.__file__).resolve().parent.parent)
ROOT = Path(__file__).resolve().parents[2]


def export(seed: int, *, width: int = 6) -> dict:
    """What a small two-node Trainer exports: float weights, a count, a mask, a half."""
    g = torch.Generator().manual_seed(seed)
    return {
        "body": {"net.0.weight": torch.randn(width, 4, generator=g),
                 "net.0.bias": torch.randn(width, generator=g),
                 "norm.num_batches_tracked": torch.tensor(seed * 10),
                 "mask": torch.rand(width, generator=g) > 0.5},
        "head": {"out.weight": torch.randn(1, width, generator=g, dtype=torch.float64),
                 "scale": torch.randn(3, generator=g).half()},
    }


# -- fedavg: the arithmetic


def test_fedavg_equals_flowers_own_weighted_average():
    aggregate = pytest.importorskip("flwr.server.strategy.aggregate").aggregate
    exports = [export(seed) for seed in range(5)]
    sizes = [120, 7, 3000, 64, 1]
    ours = fedavg(exports, sizes)
    floats = [("body", "net.0.weight"), ("body", "net.0.bias"), ("head", "out.weight"),
              ("head", "scale")]
    theirs = aggregate([([e[n][k].numpy() for n, k in floats], size)
                        for e, size in zip(exports, sizes)])
    for (node, key), flower in zip(floats, theirs):
        mine = ours[node][key]
        assert mine.dtype == exports[0][node][key].dtype and str(flower.dtype) in str(mine.dtype)
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3}[mine.dtype]
        torch.testing.assert_close(mine, torch.from_numpy(flower), rtol=tolerance, atol=tolerance)
    equal = aggregate([([e["body"]["net.0.weight"].numpy()], 1) for e in exports])[0]
    torch.testing.assert_close(fedavg(exports)["body"]["net.0.weight"], torch.from_numpy(equal))


def test_fedavg_is_the_weighted_mean_exactly_on_small_integers():
    def one(values):
        return {"n": {"w": torch.tensor(values, dtype=torch.float32).reshape(2, 2)}}

    a, b, c = one([1, 2, 3, 4]), one([5, 6, 7, 8]), one([9, 10, 11, 12])
    assert torch.equal(fedavg([a, b], [1, 3])["n"]["w"],  # (1a + 3b) / 4
                       torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(fedavg([a, b])["n"]["w"], torch.tensor([[3.0, 4.0], [5.0, 6.0]]))
    assert torch.equal(fedavg([a, b, c], [2, 1, 1])["n"]["w"],  # (2a + b + c) / 4
                       torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(fedavg([a, b, c], [0.5, 0.25, 0.25])["n"]["w"],
                       fedavg([a, b, c], [2, 1, 1])["n"]["w"])
    assert torch.equal(fedavg([c])["n"]["w"], c["n"]["w"])


def test_what_is_not_a_float_comes_from_the_first_export_as_a_copy():
    exports = [export(1), export(2), export(3)]
    average = fedavg(exports, [1, 2, 3])
    for key in ("norm.num_batches_tracked", "mask"):
        assert torch.equal(average["body"][key], exports[0]["body"][key])
        assert average["body"][key].data_ptr() != exports[0]["body"][key].data_ptr()
    assert average["body"]["norm.num_batches_tracked"].item() == 10
    assert average["body"]["mask"].dtype == torch.bool


def test_fedavg_changes_none_of_what_it_was_given():
    exports = [export(seed) for seed in range(3)]
    before = [{n: {k: v.clone() for k, v in w.items()} for n, w in e.items()} for e in exports]
    average = fedavg(exports, [3, 2, 1])
    for given, kept in zip(exports, before):
        assert all(torch.equal(given[n][k], kept[n][k]) for n in kept for k in kept[n])
    average["body"]["net.0.weight"].add_(1)
    assert torch.equal(exports[0]["body"]["net.0.weight"], before[0]["body"]["net.0.weight"])


def test_half_precision_is_summed_where_it_does_not_overflow():
    big = [{"n": {"w": torch.full((3,), 60000.0, dtype=torch.float16)}} for _ in range(4)]
    average = fedavg(big, [1000, 2000, 3000, 4000])["n"]["w"]
    assert average.dtype == torch.float16 and torch.equal(average, big[0]["n"]["w"])


def test_a_generator_of_exports_is_held_one_at_a_time():
    alive = set()
    most = [0]

    def exports():
        for seed in range(8):
            made = export(seed)
            alive.add(seed)
            weakref.finalize(made["body"]["net.0.weight"], alive.discard, seed)
            most[0] = max(most[0], len(alive))
            yield made
            del made

    streamed = fedavg(exports(), list(range(1, 9)))
    listed = fedavg([export(seed) for seed in range(8)], list(range(1, 9)))
    assert most[0] == 1  # the one being added; the one before is gone before it is made
    assert all(torch.equal(streamed[n][k], listed[n][k]) for n in listed for k in listed[n])


@pytest.mark.parametrize("change, named", [
    (lambda e: e.pop("head"), "lacks the nodes 'head'"),
    (lambda e: e.update(extra={"w": torch.zeros(1)}), "has the nodes 'extra'"),
    (lambda e: e["body"].pop("net.0.bias"), "node 'body' lacks the keys 'net.0.bias'"),
    (lambda e: e["body"].update({"net.0.weight": torch.zeros(6, 5)}),
     "node 'body', key 'net.0.weight': export 0 has shape (6, 4) and export 1 has (6, 5)"),
    (lambda e: e["head"].update({"out.weight": torch.zeros(1, 6)}),
     "node 'head', key 'out.weight': export 0 is torch.float64 and export 1 is torch.float32"),
    (lambda e: e["head"].update({"out.weight": [1.0]}),
     "node 'head', key 'out.weight': export 0 holds a tensor and export 1 a list"),
], ids=["missing-node", "extra-node", "missing-key", "shape", "dtype", "not-a-tensor"])
def test_exports_that_disagree_are_refused_naming_what_differs(change, named):
    other = export(1)
    change(other)
    with pytest.raises(DeclarationError) as caught:
        fedavg([export(0), other])
    assert named in str(caught.value)


@pytest.mark.parametrize("exports, sizes, error, named", [
    ([], None, ValueError, "no exports"),
    ([export(0), export(1)], [1], ValueError, "2 exports and 1 sizes"),
    ([export(0)], [1, 2], ValueError, "1 exports and 2 sizes"),
    ([export(0), export(1)], [1, 0], ValueError, "sizes[1] is 0"),
    ([export(0), export(1)], [-3, 1], ValueError, "sizes[0] is -3"),
    ([export(0), export(1)], [1, float("nan")], ValueError, "sizes[1] is nan"),
    ([export(0), export(1)], [True, 1], TypeError, "sizes[0] is a bool"),
    ([export(0), export(1)], "12", TypeError, "not a str"),
    ([export(0), [1, 2]], None, TypeError, "export 1 is a list"),
    ([{"n": [1]}], None, TypeError, "node 'n'"),
], ids=["empty", "few-sizes", "many-sizes", "zero", "negative", "nan", "bool", "str",
        "not-a-mapping", "not-weights"])
def test_what_cannot_be_averaged_is_refused(exports, sizes, error, named):
    with pytest.raises(error) as caught:
        fedavg(exports, sizes)
    assert named in str(caught.value)


# -- gather, inside one process


def part(mine: int) -> dict:
    return {"n": {"w": torch.full((3,), float(mine)), "steps": torch.tensor(mine)}}


def together(store, clients: int, **how) -> list:
    """Runs gather for every client at once, in threads; answers what each got or raised."""
    answers: list = [None] * clients

    def one(k):
        try:
            answers[k] = gather(store, part(k), clients=clients, mine=k, **how)
        except Exception as exc:  # noqa: BLE001 - handed to the test to look at
            answers[k] = exc

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers


def test_one_round_gives_everybody_the_weighted_average(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    answers = together(store, 3, run="r", round=0, asking=0.01)
    assert all(torch.equal(a["n"]["w"], torch.full((3,), 1.0)) for a in answers)
    assert all(torch.equal(a["n"]["steps"], torch.tensor(0)) for a in answers)
    names = [b.name for b in store.bound("fed/r/0")]
    assert names == ["fed/r/0/average", "fed/r/0/averaging", "fed/r/0/client/0",
                     "fed/r/0/client/1", "fed/r/0/client/2"]
    assert store.resolve("fed/r/0/client/2").meta["size"] is None


def test_sizes_travel_in_the_meta_and_weigh_the_average(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    answers = [None, None]
    threads = [threading.Thread(target=lambda k=k: answers.__setitem__(k, gather(
        store, part(k * 4), run="r", round=3, clients=2, mine=k, size=[1, 3][k],
        asking=0.01))) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(torch.equal(a["n"]["w"], torch.full((3,), 3.0)) for a in answers)  # (0 + 12)/4
    assert store.resolve("fed/r/3/client/1").meta["size"] == 3
    assert store.resolve("fed/r/3/average").meta["sizes"] == [1.0, 3.0]


def test_asking_again_gives_the_same_answer_and_keeps_the_first_part(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    first = gather(store, part(5), run="r", round=0, clients=1, mine=0)
    again = gather(store, part(9), run="r", round=0, clients=1, mine=0)
    assert torch.equal(first["n"]["w"], again["n"]["w"]) and first["n"]["w"][0] == 5
    assert store.recall("fed/r/0/client/0")["n"]["w"][0] == 5


def poisoned(mine: int) -> dict:
    export = part(mine)
    export["n"]["w"][1] = float("nan")
    return export


def test_a_part_holding_nan_is_refused_naming_the_client_before_it_is_kept(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(ValueError, match=r"round 0 of run 'r': client 1's part holds 1 NaN or "
                                         r"inf value in node 'n', key 'w'.*nonfinite='warn'"):
        gather(store, poisoned(1), run="r", round=0, clients=2, mine=1, within=5, asking=0.01)
    assert store.bound("fed/r/0") == []  # nothing kept: the round is not poisoned
    infinite = part(0)
    infinite["n"]["w"][0] = float("inf")
    with pytest.raises(ValueError, match="client 0's part holds 1 NaN or inf"):
        gather(store, infinite, run="r", round=0, clients=1, mine=0)
    with pytest.raises(ValueError, match="nonfinite='never' is refused"):
        gather(store, part(0), run="r", round=0, clients=1, mine=0, nonfinite="never")


def test_another_clients_nan_part_is_refused_by_whoever_averages_or_warned_about(tmp_path):
    from somatize._codec import dumps

    store = Store(tmp_path / "s", durable=False)
    for round in (0, 1):  # client 1 as a writer that did not check: its part kept as is
        store.claim(f"fed/r/{round}/client/1", store.put(dumps(poisoned(1))),
                    {"client": 1, "clients": 2, "size": None, "by": "elsewhere"})
    with pytest.raises(ValueError, match="round 0 of run 'r': client 1's part holds 1 NaN"):
        gather(store, part(0), run="r", round=0, clients=2, mine=0, within=5, asking=0.01)
    assert store.resolve("fed/r/0/average") is None  # no average was written from it
    with pytest.warns(UserWarning, match="client 1's part holds 1 NaN .* averaged in as asked"):
        average = gather(store, part(0), run="r", round=1, clients=2, mine=0, within=5,
                         asking=0.01, nonfinite="warn")
    assert torch.isnan(average["n"]["w"][1]) and average["n"]["w"][0] == 0.5


def test_clients_that_disagree_on_sizes_or_numbers_are_refused(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    answers = [None, None]

    def one(k, **how):
        try:
            gather(store, part(k), run="r", round=0, mine=k, asking=0.01, within=5, **how)
        except Exception as exc:  # noqa: BLE001
            answers[k] = exc

    threads = [threading.Thread(target=one, args=(0,), kwargs={"clients": 2, "size": 10}),
               threading.Thread(target=one, args=(1,), kwargs={"clients": 2})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(isinstance(a, ValueError) and "clients [1] gave no size=" in str(a)
               for a in answers)
    with pytest.raises(ValueError, match="client 0 kept its part saying there are 2 clients "
                                         "and this one says 3"):
        gather(store, part(2), run="r", round=0, clients=3, mine=2, within=5, asking=0.01)


def test_an_averager_that_never_finishes_is_named_when_the_others_give_up(tmp_path,
                                                                          monkeypatch):
    import somatize.torch._federated as federated

    def stuck(*args, **kwargs):
        raise RuntimeError("the averager fell over")

    monkeypatch.setattr(federated, "fedavg", stuck)
    store = Store(tmp_path / "s", durable=False)
    answers = together(store, 3, run="r", round=0, asking=0.01, within=1.5, lease=60)
    fell = [a for a in answers if isinstance(a, RuntimeError) and "fell over" in str(a)]
    late = [a for a in answers if isinstance(a, TimeoutError)]
    assert len(fell) == 1 and len(late) == 2
    averager = store.resolve("fed/r/0/averaging").meta
    assert all("average was never written" in str(a) and averager["by"] in str(a)
               and f"(client {averager['client']})" in str(a) for a in late)


@pytest.mark.parametrize("how, error, named", [
    ({"mine": 4}, ValueError, "mine=4 is not one of the 4 clients"),
    ({"mine": -1}, ValueError, "mine is 0 to 3"),
    ({"clients": 0, "mine": 0}, ValueError, "clients=0 is refused"),
    ({"round": -1}, ValueError, "round=-1 is refused"),
    ({"round": 1.0}, TypeError, "round= is an int"),
    ({"run": "a/b"}, BadName, "one name part"),
    ({"run": ".."}, BadName, "'.'"),
    ({"run": ""}, BadName, "empty"),
    ({"size": 0}, ValueError, "size=0 is refused"),
    ({"asking": 0}, ValueError, "asking=0 is refused"),
    ({"within": "soon"}, ValueError, "within='soon'"),
    ({"lease": -1}, ValueError, "lease=-1"),
    ({"what": [1, 2]}, TypeError, "what= is a list"),
    ({"store": "/tmp/x"}, TypeError, "not a str"),
], ids=lambda case: ascii(case)[:24])
def test_what_cannot_make_a_round_is_refused_before_anything_is_kept(tmp_path, how, error,
                                                                     named):
    store = Store(tmp_path / "s", durable=False)
    given = {"store": store, "what": part(0), "run": "r", "round": 0, "clients": 4,
             "mine": 1, **how}
    with pytest.raises(error) as caught:
        gather(given.pop("store"), given.pop("what"), **given)
    assert named in str(caught.value)
    assert store.bound() == []


# -- gather, across processes


CLIENT = """
import json, os, signal, sys
import torch
import somatize.torch._federated as federated
from somatize.store import Store

where, run, mine, clients, rounds, dying = sys.argv[1:7]
mine, clients, rounds = int(mine), int(clients), int(rounds)
store = Store(where, durable=False)
if dying:  # the first client to start averaging dies right then: claimed, never written
    real = federated.fedavg
    def fedavg(*args, **kwargs):
        try:
            os.close(os.open(dying, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    federated.fedavg = fedavg
shift = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0  # a restart may bring other weights
weights = {"n": {"w": torch.arange(4.0) * (mine + 1) + shift}}
for round in range(rounds):
    average = federated.gather(store, weights, run=run, round=round, clients=clients,
                               mine=mine, size=mine + 1, asking=0.05, within=float(
                               os.environ.get("WITHIN", "30")), lease=1.0,
                               secret=os.environ.get("SECRET"))
    weights = {"n": {"w": average["n"]["w"] + 1}}
print(json.dumps(average["n"]["w"].tolist()))
"""


def client(where, run, mine, clients, rounds=1, dying="", *extra, within=30.0, secret=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               WITHIN=str(within))
    if secret is not None:
        env["SECRET"] = secret
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(where), run, str(mine), str(clients), str(rounds),
         dying, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(children, timeout=90):
    said = []
    try:
        for child in children:
            out, err = child.communicate(timeout=timeout)
            said.append((child.returncode, out, err))
    finally:
        for child in children:
            child.kill()
            child.wait()
    return said


def test_a_killed_client_makes_the_others_time_out_naming_it(tmp_path):
    where = tmp_path / "s"
    Store(where)
    killed = client(where, "r", 1, 3, within=2.0)
    killed.send_signal(signal.SIGKILL)  # before it kept anything
    others = [client(where, "r", k, 3, within=2.0) for k in (0, 2)]
    said = finish(others + [killed])
    assert said[-1][0] == -signal.SIGKILL
    for code, _, err in said[:-1]:
        assert code != 0
        assert "TimeoutError" in err and "client 1 never kept a part within 2 s" in err, err
        assert "(2 of 3 did)" in err


def test_an_averager_killed_between_claim_and_write_does_not_wedge_the_round(tmp_path):
    where = tmp_path / "s"
    store = Store(where)
    marker = str(tmp_path / "died")
    said = finish([client(where, "r", k, 3, 1, marker) for k in range(3)])
    codes = [code for code, *_ in said]
    assert sorted(codes) == [-signal.SIGKILL, 0, 0], said
    dead = codes.index(-signal.SIGKILL)
    assert store.resolve("fed/r/0/averaging").meta["client"] == dead
    successor = store.resolve("fed/r/0/averaging/2").meta["client"]
    assert successor != dead and store.resolve("fed/r/0/average").meta["turn"] == 2
    answers = [json.loads(out) for code, out, _ in said if code == 0]
    parts = [store.recall(f"fed/r/0/client/{k}") for k in range(3)]
    expected = fedavg(parts, [1, 2, 3])["n"]["w"]
    assert all(torch.equal(torch.tensor(a), expected) for a in answers)
    # The dead client comes back, with other weights: the round's answer stands.
    (code, out, err), = finish([client(where, "r", dead, 3, 1, marker, "100")])
    assert code == 0, err
    assert torch.equal(torch.tensor(json.loads(out)), expected)
    assert torch.equal(store.recall(f"fed/r/0/client/{dead}")["n"]["w"], parts[dead]["n"]["w"])


# -- a secret: who may write the store no longer decides what the round answers


SECRET = "a-secret-every-client-of-the-run-is-given-" + "x" * 16

PLANT = """
import sys
import torch
import somatize.torch
from somatize.store import Store
store = Store(sys.argv[1])
for name, mac in zip(sys.argv[2::2], sys.argv[3::2]):
    meta = {"clients": 3, "client": 1, "size": 2, "sizes": [1.0, 2.0, 3.0], "by": "mallory"}
    if mac:
        meta["mac"] = mac
    store.keep("planted/" + name.replace("/", "."), {"n": {"w": torch.full((4,), 666.0)}})
    assert store.claim(name, store.resolve("planted/" + name.replace("/", ".")).digest, meta)
"""


def plant(where, *names_and_macs):
    """A real process that may write the store, without the secret, claiming names first."""
    done = subprocess.run([sys.executable, "-c", PLANT, str(where), *names_and_macs],
                          env=dict(os.environ, PYTHONPATH=SRC), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_round_with_a_secret_is_signed_and_a_replaced_average_is_refused(tmp_path):
    where = tmp_path / "s"
    store = Store(where)
    said = finish([client(where, "r", k, 3, secret=SECRET) for k in range(3)])
    assert [code for code, *_ in said] == [0, 0, 0], said
    answers = {out for _, out, _ in said}
    assert len(answers) == 1
    names = ["fed/r/0/average"] + [f"fed/r/0/client/{k}" for k in range(3)]
    assert all(len(store.resolve(name).meta["mac"]) == 64 for name in names)
    # A writer of the store binds its own object under the real average's name and meta
    # (its MAC included): the MAC is of the name and digest too, so it does not pass.
    real = store.resolve("fed/r/0/average")
    store.bind("fed/r/0/average", store.keep("mine", {"n": {"w": torch.zeros(4)}}), real.meta)
    (code, _, err), = finish([client(where, "r", 0, 3, secret=SECRET)])
    assert code != 0 and "StoreError" in err
    assert "fed/r/0/average" in err and "carries a MAC this secret does not make" in err
    # ...nor does the real one, copied to the next round's name.
    store.bind("fed/r/0/average", real.digest, real.meta)
    store.bind("fed/r/1/average", real.digest, real.meta)
    assert json.loads(finish([client(where, "r", 0, 3, secret=SECRET)])[0][1]) == \
        json.loads(answers.pop())
    with pytest.raises(somatize.StoreError, match="fed/r/1/average"):
        gather(store, part(0), run="r", round=1, clients=3, mine=0, secret=SECRET, within=5)


@pytest.mark.slow
def test_a_writer_without_the_secret_cannot_forge_a_round(tmp_path):
    where = tmp_path / "s"
    Store(where)
    plant(where, "fed/a/0/average", "", "fed/b/0/average", "0" * 64, "fed/c/0/client/1", "")
    said = finish([client(where, "a", 0, 3, secret=SECRET), client(where, "a", 1, 3),
                   client(where, "b", 0, 3, secret=SECRET)]
                  + [client(where, "c", k, 3, secret=SECRET) for k in range(3)])
    (code, _, err), unsigned, (forged, _, said_b), *parts = said
    assert code != 0 and "fed/a/0/average" in err and "carries no MAC" in err, err
    assert "'mallory'" in err
    assert unsigned[0] == 0 and json.loads(unsigned[1]) == [666.0] * 4  # no secret: taken
    assert forged != 0 and "fed/b/0/average" in said_b and "does not make" in said_b, said_b
    for code, _, err in parts:  # client 1's own part lost its claim to the planted one
        assert code != 0 and "fed/c/0/client/1 in " in err and "carries no MAC" in err, err
    assert Store(where).resolve("fed/c/0/average") is None


def test_a_secret_is_a_str_or_bytes_and_a_short_one_is_warned_of(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(TypeError, match="secret= is a str or bytes"):
        gather(store, part(0), run="r", round=0, clients=1, mine=0, secret=12)
    with pytest.raises(ValueError, match="secret= is empty"):
        gather(store, part(0), run="r", round=0, clients=1, mine=0, secret=b"")
    assert store.bound() == []
    with pytest.warns(UserWarning, match="secret= is 5 bytes"):
        done = gather(store, part(3), run="r", round=0, clients=1, mine=0, secret="short")
    assert torch.equal(done["n"]["w"], part(3)["n"]["w"])
    with pytest.warns(UserWarning, match="secret= is 5 bytes"):
        again = gather(store, part(4), run="r", round=0, clients=1, mine=0, secret=b"short")
    assert again["n"]["w"][0] == 3  # str and bytes: the same secret


# -- the example: processes on a folder, submitit on a bucket


def example(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "federated.py"), *args],
                          check=False, env=env, capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def check_the_run(store: Store, run: str, clients: int, rounds: int) -> None:
    """Every client ended with the same weights: the last round's average, which is the
    size-weighted mean of what the clients kept for it."""
    finals = [store.recall(f"fed/{run}/final/{k}") for k in range(clients)]
    last = store.recall(f"fed/{run}/{rounds - 1}/average")
    parts = [store.resolve(f"fed/{run}/{rounds - 1}/client/{k}") for k in range(clients)]
    expected = fedavg([store.recall(p.name) for p in parts], [p.meta["size"] for p in parts])
    for node, weights in last.items():
        for key, value in weights.items():
            assert torch.equal(value, expected[node][key]), (node, key)
            assert all(torch.equal(final[node][key], value) for final in finals), (node, key)
    assert [p.meta["size"] for p in parts] == [48, 96, 144, 192]


def test_the_example_with_four_processes_on_a_folder(tmp_path):
    done = example("--clients", "4", "--rounds", "3", "--steps", "4", "--asking", "0.05",
                   "--store", str(tmp_path / "s"), "--run", "demo")
    assert done.returncode == 0, done.stderr
    assert "every client ends with the same weights: yes" in done.stdout
    check_the_run(Store(tmp_path / "s"), "demo", 4, 3)


def s3_server():
    """The bucket tests' own moto server, from tests/store/s3server.py."""
    path = ROOT / "tests" / "store" / "s3server.py"
    spec = importlib.util.spec_from_file_location("_s3_for_federated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_through_submitit_on_a_bucket(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    servers = s3_server()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", servers.KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", servers.SECRET)
    with servers.s3_server() as endpoint:
        servers.make_bucket(endpoint, "federated")
        done = example("--via", "submitit", "--clients",
                       "4", "--rounds", "3", "--steps", "4", "--asking", "0.05",
                       "--endpoint", endpoint, "--bucket", "federated", "--prefix", "fed",
                       "--run", "demo", cwd=tmp_path)
        assert done.returncode == 0, done.stderr + done.stdout
        assert "every client ends with the same weights: yes" in done.stdout
        check_the_run(Store.on_bucket(endpoint, "federated", prefix="fed"), "demo", 4, 3)
    # submitit's files: by default in a folder of this run's own, where it was started
    assert len(list((tmp_path / "submitit-logs" / "demo").glob("*_result.pkl"))) == 4


def test_on_slurm_the_executor_is_the_one_line_that_changes(tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    spec = importlib.util.spec_from_file_location("federated_example",
                                                  ROOT / "examples" / "federated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    here = module.executor("submitit", str(tmp_path / "logs"), None)
    assert isinstance(here, submitit.LocalExecutor)
    # submitit looks for srun before it builds a Slurm executor; nothing here runs it.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cluster = module.executor("slurm", str(tmp_path / "logs"), "gpu")
    assert isinstance(cluster, submitit.AutoExecutor) and cluster.cluster == "slurm"
    assert cluster._executor.parameters["partition"] == "gpu"  # submitit took our parameters
    assert cluster._executor.parameters["time"] == 30


# -- what a round does with its parts: a rule, a server optimizer, a quorum


def test_a_round_with_a_robust_rule_answers_that_rule_on_the_parts(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(5)}
    answers, _ = gathered(store, parts, run="r", round=0, clients=5, asking=0.01,
                          aggregate=fedmedian)
    expected = fedmedian([parts[k] for k in range(5)])
    answers2, _ = gathered(store, parts, run="r", round=1, clients=5, asking=0.01,
                           aggregate=lambda e, s: krum(e, s, byzantine=1, keep=2))
    picked = krum([parts[k] for k in range(5)], byzantine=1, keep=2)
    for k in range(5):
        assert torch.equal(answers[k]["n"]["w"], expected["n"]["w"])
        assert torch.equal(answers2[k]["n"]["w"], picked["n"]["w"])


# -- server optimizers: state carried by the store


def rounds_averaged_by(store, averagers, server, clients=3, sizes=(30, 10, 60)):
    """Runs len(averagers) rounds; in round r only client averagers[r] averages (the
    others' parts are kept before it asks, and they ask after it answered)."""
    start, run = weights(0), "r"
    current = start
    for round, averager in enumerate(averagers):
        parts = {k: trained(current, k, round) for k in range(clients)}
        for k in range(clients):
            if k != averager:
                keep_as(store, run, round, k, parts[k], clients, sizes[k])
        answer = gather(store, parts[averager], run=run, round=round, clients=clients,
                        mine=averager, size=sizes[averager], server=server, start=start,
                        asking=0.01, within=20)
        assert store.resolve(f"fed/r/{round}/averaging").meta["client"] == averager
        for k in range(clients):  # the others get the same answer, and average nothing
            other = gather(store, parts[k], run=run, round=round, clients=clients, mine=k,
                           size=sizes[k], server=server, start=start, within=20)
            assert all(torch.equal(other["n"][key], answer["n"][key]) for key in answer["n"])
        current = answer
    return current


@pytest.mark.parametrize("server", [FedAdam(eta=0.05), FedAvgM(learning_rate=0.8,
                                                                 momentum=0.9)],
                         ids=["adam", "avgm"])
def test_the_server_state_is_continued_by_whichever_client_averages(tmp_path, server):
    one = rounds_averaged_by(Store(tmp_path / "a", durable=False), [0, 1, 2, 0], server)
    other = rounds_averaged_by(Store(tmp_path / "b", durable=False), [2, 0, 1, 1], server)
    assert all(torch.equal(one["n"][k], other["n"][k]) for k in one["n"])
    # ...and the same four rounds with one optimizer kept in memory throughout:
    current, state = weights(0), None
    for round in range(4):
        parts = [trained(current, k, round) for k in range(3)]
        current, state = server.step(current, fedavg(parts, [30, 10, 60]), state)
    assert all(torch.equal(one["n"][k], current["n"][k]) for k in one["n"])


def test_the_server_state_equals_flowers_fedadam_over_the_same_rounds(tmp_path):
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, \
        parameters_to_ndarrays
    from flwr.server.strategy import FedAdam as FlowerFedAdam

    ours = rounds_averaged_by(Store(tmp_path / "a", durable=False), [1, 2, 0],
                              FedAdam(eta=0.05))
    floats = lambda e: [e["n"]["w"].numpy(), e["n"]["b"].numpy()]  # noqa: E731
    flower = FlowerFedAdam(initial_parameters=ndarrays_to_parameters(floats(weights(0))),
                           eta=0.05)
    current = weights(0)
    for round in range(3):
        parts = [trained(current, k, round) for k in range(3)]
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(floats(p)), n, {}))
                   for p, n in zip(parts, [30, 10, 60])]
        w, b = parameters_to_ndarrays(flower.aggregate_fit(round + 1, results, [])[0])
        current = {"n": {"w": torch.from_numpy(w).float(), "b": torch.from_numpy(b),
                         "steps": parts[0]["n"]["steps"]}}
    torch.testing.assert_close(ours["n"]["w"], current["n"]["w"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["n"]["b"], current["n"]["b"], rtol=1e-12, atol=1e-12)


def test_a_first_round_with_a_server_and_no_start_is_refused_before_anything_is_kept(
        tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(ValueError, match="give them as start="):
        gather(store, weights(0), run="r", round=0, clients=2, mine=0, server=FedAdam())
    assert store.bound() == []


# -- quorum


def test_a_quorum_round_closes_without_a_straggler_who_then_takes_its_average(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(4)}
    began = time.monotonic()
    answers, told = gathered(store, {k: parts[k] for k in range(3)}, run="r", round=0,
                             clients=4, quorum=3, within=1.0, asking=0.05,
                             size=None)
    assert time.monotonic() - began >= 1.0  # it waited for the straggler until within=
    expected = fedavg([parts[k] for k in range(3)])
    assert all(torch.equal(answers[k]["n"]["w"], expected["n"]["w"]) for k in range(3))
    said = [m for k in range(3) for m in told[k]]
    assert len(said) == 1 and "closed at its quorum without client 3" in said[0]
    assert store.resolve("fed/r/0/average").meta["parts"] == [0, 1, 2]
    # the straggler turns up: it keeps nothing and takes the closed round's average
    with pytest.warns(UserWarning, match="closed without client 3's part"):
        late = gather(store, parts[3], run="r", round=0, clients=4, mine=3, quorum=3,
                      within=1.0)
    assert torch.equal(late["n"]["w"], expected["n"]["w"])
    assert store.resolve("fed/r/0/client/3") is None
    # a part kept after the round closed (a client that asked just before) is in no
    # average: not this round's, which stands, and the next round has names of its own
    keep_as(store, "r", 0, 3, parts[3], 4, None)
    with pytest.warns(UserWarning, match="closed without client 3's part"):
        again = gather(store, parts[3], run="r", round=0, clients=4, mine=3, quorum=3)
    assert torch.equal(again["n"]["w"], expected["n"]["w"])
    # it joins the next round, which all four make, at once (no waiting for within=)
    began = time.monotonic()
    answers, told = gathered(store, {k: trained(expected, k, 1) for k in range(4)}, run="r",
                             round=1, clients=4, quorum=3, within=30.0, asking=0.05)
    assert time.monotonic() - began < 10
    assert store.resolve("fed/r/1/average").meta["parts"] == [0, 1, 2, 3]
    assert not any(told.values())


def test_a_quorum_not_reached_times_out_naming_who_is_missing(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    answers, _ = gathered(store, {0: weights(0), 1: weights(1)}, run="r", round=0,
                          clients=4, quorum=3, within=0.5, asking=0.05, lease=0.5)
    for k in (0, 1):
        assert isinstance(answers[k], TimeoutError)
        assert "clients 2, 3 never kept a part within 0.5 s (2 of 4 did)" in str(answers[k])


def test_a_quorum_is_checked(tmp_path):
    store = Store(tmp_path / "s", durable=False)
    with pytest.raises(ValueError, match="quorum=5 is refused"):
        gather(store, weights(0), run="r", round=0, clients=4, mine=0, quorum=5)
    with pytest.raises(ValueError, match="leave out aggregate="):
        gather(store, weights(0), run="r", round=0, clients=4, mine=0, aggregate=fedmedian,
               privacy=ClientPrivacy(clip=1.0, noise=1.0), start=weights(0))
    assert store.bound() == []


QUORUM_CLIENT = """
import json, sys, time, warnings
import torch
from somatize.store import Store
from somatize.torch import gather
where, mine, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(wait)
store = Store(where, durable=False)
weights = {"n": {"w": torch.arange(4.0) * (mine + 1)}}
said = []
for round in range(2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        average = gather(store, weights, run="q", round=round, clients=4, mine=mine,
                         size=mine + 1, quorum=3, within=[1.5, 60.0][round], asking=0.05)
    said.append([str(w.message) for w in caught])
    weights = {"n": {"w": average["n"]["w"] + 1}}
print(json.dumps({"w": average["n"]["w"].tolist(), "said": said}))
"""


@pytest.mark.slow
def test_a_quorum_round_with_processes_on_a_directory(tmp_path):
    where = tmp_path / "s"
    Store(where)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    children = [subprocess.Popen([sys.executable, "-c", QUORUM_CLIENT, str(where), str(k),
                                  "0" if k < 3 else "6"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k in range(4)]
    said = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        said.append(json.loads(out))
    store = Store(where)
    first = store.resolve("fed/q/0/average").meta
    assert first["parts"] == [0, 1, 2] and first["sizes"] == [1.0, 2.0, 3.0]
    expected = fedavg([store.recall(f"fed/q/0/client/{k}") for k in range(3)], [1, 2, 3])
    assert torch.equal(store.recall("fed/q/0/average")["n"]["w"], expected["n"]["w"])
    assert store.resolve("fed/q/0/client/3") is None  # the straggler kept nothing in round 0
    assert any("closed at its quorum without client 3" in m for s in said[:3] for m in s["said"][0])
    assert any("closed without client 3's part" in m for m in said[3]["said"][0])
    # in round 1 the straggler started from round 0's average, like the others
    assert torch.equal(store.recall("fed/q/1/client/3")["n"]["w"], expected["n"]["w"] + 1)
    assert store.resolve("fed/q/1/average").meta["parts"] == [0, 1, 2, 3]
    assert len({json.dumps(s["w"]) for s in said}) == 1


def test_a_server_round_refuses_a_replaced_average_of_the_round_before(tmp_path):
    secret = "a-secret-every-client-of-the-run-is-given-" + "x" * 16
    store = Store(tmp_path / "s", durable=False)
    parts = {k: weights(k) for k in range(2)}
    answers, _ = gathered(store, parts, run="r", round=0, clients=2, asking=0.01,
                          secret=secret, server=FedAdam(), start=weights(0))
    assert all(isinstance(a, dict) for a in answers.values())
    real = store.resolve("fed/r/0/average")
    store.bind("fed/r/0/average", store.put(dumps(weights(9))), real.meta)
    with pytest.raises(somatize.StoreError, match="fed/r/0/average"):
        gather(store, parts[0], run="r", round=1, clients=2, mine=0, secret=secret,
               server=FedAdam(), start=weights(0))
    assert store.resolve("fed/r/1/client/0") is None
