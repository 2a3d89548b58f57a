"""Client-level differential privacy through real rounds: clipped, noised the same
whoever averages, and its epsilon the one Google's dp-accounting composes."""

from __future__ import annotations

import pytest
import torch
from fedrounds import gathered, keep_as, trained, weights

from somatize.store import Store
from somatize.torch import ClientPrivacy, fedavg, gather, noise_for, privacy_spent

pytest.importorskip("dp_accounting")


def test_privacy_clips_noises_and_counts_epsilon_with_dp_accounting(tmp_path):
    accounting = pytest.importorskip("dp_accounting")
    store = Store(tmp_path / "s", durable=False)
    start = {"n": {"w": torch.zeros(1000), "steps": torch.tensor(0)}}
    privacy = ClientPrivacy(clip=1.0, noise=0.5, delta=1e-5, seed=7, population=8)
    current = start
    for round in range(3):
        parts = {k: {"n": {"w": current["n"]["w"] + (k + 1) * 10.0, "steps": torch.tensor(1)}}
                 for k in range(4)}
        answers, _ = gathered(store, parts, run="p", round=round, clients=4, asking=0.01,
                              privacy=privacy, start=start)
        update = answers[0]["n"]["w"] - current["n"]["w"]
        # every update clipped to norm 1 (all point the same way): their mean is
        # 1/sqrt(1000) per weight; the noise has deviation 0.5 * 1 / 4 around it
        clipped = 1.0 / 1000 ** 0.5
        assert abs(float(update.mean()) - clipped) < 4 * 0.125 / 1000 ** 0.5
        assert abs(float(update.std()) - 0.125) < 0.02
        assert all(torch.equal(answers[k]["n"]["w"], answers[0]["n"]["w"]) for k in range(4))
        current = answers[0]
    accountant = accounting.rdp.RdpAccountant()
    accountant.compose(accounting.dp_event.PoissonSampledDpEvent(
        4 / 8, accounting.dp_event.GaussianDpEvent(0.5)), 3)
    spent = privacy_spent(store, "p")
    assert list(spent) == [0, 1, 2]
    assert spent[2] == accountant.get_epsilon(1e-5) and spent[0] < spent[1] < spent[2]


def test_privacy_noise_is_the_same_whoever_averages(tmp_path):
    privacy = ClientPrivacy(clip=0.5, noise=1.0, seed=3)
    start = weights(0)
    answers = []
    for averager, where in ((0, "a"), (1, "b")):
        store = Store(tmp_path / where, durable=False)
        keep_as(store, "r", 0, 1 - averager, trained(start, 1 - averager, 0), 2, None)
        answers.append(gather(store, trained(start, averager, 0), run="r", round=0, clients=2,
                              mine=averager, privacy=privacy, start=start, asking=0.01))
    assert torch.equal(answers[0]["n"]["w"], answers[1]["n"]["w"])
    assert not torch.equal(answers[0]["n"]["w"], fedavg([trained(start, k, 0)
                                                        for k in range(2)])["n"]["w"])


def test_noise_for_spends_the_epsilon_asked_for():
    from somatize.torch._dp import _epsilon  # the accountant's composition, as rounds record it

    for epsilon, rounds, sampled in ((1.0, 20, 1.0), (8.0, 5, 0.5)):
        noise = noise_for(epsilon, 1e-5, rounds, sampled)
        assert _epsilon([[sampled, noise]] * rounds, 1e-5) == pytest.approx(epsilon, rel=1e-3)


def test_what_cannot_be_private_is_refused():
    with pytest.raises(ValueError, match="clip=0 is refused"):
        ClientPrivacy(clip=0, noise=1.0)
    with pytest.raises(ValueError, match="noise=-1 is refused"):
        ClientPrivacy(clip=1.0, noise=-1)
    with pytest.raises(ValueError, match="delta=1 is refused"):
        ClientPrivacy(clip=1.0, noise=1.0, delta=1)
