"""The robust aggregators against Flower's own functions on the same weights, and with
attackers in the crowd that they have to leave out."""

from __future__ import annotations

import pytest
import torch

from somatize.torch import bulyan, fedavg, fedmedian, fedtrimmedavg, krum

aggregate = pytest.importorskip("flwr.server.strategy.aggregate")

FLOATS = [("body", "w"), ("body", "b"), ("head", "out"), ("head", "half")]


def export(seed: int, shift: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"body": {"w": torch.randn(5, 3, generator=g) + shift,
                     "b": torch.randn(5, generator=g) + shift,
                     "steps": torch.tensor(seed)},
            "head": {"out": torch.randn(2, 5, generator=g, dtype=torch.float64) + shift,
                     "half": (torch.randn(4, generator=g) + shift).half(),
                     "mask": torch.arange(3) > seed % 3}}


def flower(exports, sizes):
    return [([e[n][k].numpy() for n, k in FLOATS], size) for e, size in zip(exports, sizes)]


def same(ours, theirs, exports):
    for (node, key), value in zip(FLOATS, theirs):
        mine = ours[node][key]
        assert mine.dtype == exports[0][node][key].dtype
        tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}[mine.dtype]
        torch.testing.assert_close(mine, torch.from_numpy(value).to(mine.dtype),
                                   rtol=tolerance, atol=tolerance)
    for node, key in (("body", "steps"), ("head", "mask")):  # the first's, as fedavg does
        assert torch.equal(ours[node][key], exports[0][node][key])


@pytest.mark.parametrize("count", [5, 6])
def test_fedmedian_equals_flowers_median(count):
    exports = [export(seed) for seed in range(count)]
    sizes = list(range(10, 10 + count))
    same(fedmedian(exports, sizes), aggregate.aggregate_median(flower(exports, sizes)),
         exports)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.35])
def test_fedtrimmedavg_equals_flowers_trimmed_mean(beta):
    exports = [export(seed) for seed in range(9)]
    sizes = [1] * 9
    same(fedtrimmedavg(exports, beta=beta),
         aggregate.aggregate_trimmed_avg(flower(exports, sizes), beta), exports)


def crowd(honest: int, attackers: int) -> list:
    """Honest clients near each other; attackers far off, sign-flipped and scaled."""
    exports = [export(seed) for seed in range(honest)]
    for seed in range(attackers):
        bad = export(100 + seed)
        for node, key in FLOATS:
            bad[node][key] = bad[node][key] * -10
        exports.append(bad)
    return exports


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_krum_and_multikrum_equal_flowers(keep):
    exports = crowd(7, 2)
    sizes = [3, 9, 1, 4, 7, 2, 8, 5, 6]
    ours = krum(exports, sizes, byzantine=2, keep=keep)
    same(ours, aggregate.aggregate_krum(flower(exports, sizes), 2, keep), exports)


def test_krum_picks_one_of_the_honest_exports_as_it_was():
    exports = crowd(7, 2)
    chosen = krum(exports, byzantine=2)
    assert any(all(torch.equal(chosen[n][k], e[n][k]) for n, k in FLOATS)
               for e in exports[:7])


def test_bulyan_equals_flowers():
    exports = crowd(9, 2)
    sizes = list(range(1, 12))
    theirs = aggregate.aggregate_bulyan(flower(exports, sizes), 2, aggregate.aggregate_krum,
                                        to_keep=0)
    same(bulyan(exports, sizes, byzantine=2), theirs, exports)


def test_the_robust_ones_stay_near_the_honest_mean_where_fedavg_does_not():
    exports = crowd(9, 2)
    honest = fedavg(exports[:9])["body"]["w"]
    for combined in (fedmedian(exports), fedtrimmedavg(exports, beta=0.2),
                     krum(exports, byzantine=2, keep=4), bulyan(exports, byzantine=2)):
        assert (combined["body"]["w"] - honest).abs().max() < 1.5
    assert (fedavg(exports)["body"]["w"] - honest).abs().max() > 1.5


def test_what_they_cannot_do_is_refused_naming_it():
    exports = crowd(5, 0)
    with pytest.raises(ValueError, match="needs at least 4 \\* byzantine \\+ 3 = 11"):
        bulyan(exports, byzantine=2)
    with pytest.raises(ValueError, match="beta=0.5 is refused"):
        fedtrimmedavg(exports, beta=0.5)
    with pytest.raises(ValueError, match="keep=6 is more than the 5 exports"):
        krum(exports, byzantine=1, keep=6)
    with pytest.raises(ValueError, match="byzantine=-1 is refused"):
        krum(exports, byzantine=-1)
    with pytest.raises(ValueError, match="fedmedian\\(\\) got 5 exports and 2 sizes"):
        fedmedian(exports, [1, 2])
    with pytest.raises(ValueError, match="no exports"):
        fedmedian([])
    odd = export(9)
    odd["body"].pop("b")
    with pytest.raises(somatize_error(), match="lacks the keys 'b'"):
        fedmedian([exports[0], odd])


def somatize_error():
    from somatize import DeclarationError
    return DeclarationError
