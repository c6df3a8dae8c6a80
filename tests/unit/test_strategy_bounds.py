"""Finite but absurd strategy parameters are refused by the constructor, in one line: with them every round's
update is non-finite (and skipped) or a round never fills, and the job would only wait on its deadlines."""

from __future__ import annotations

import pytest

from fedmq.aggregator.strategies.buffered_async import BufferedAsync
from fedmq.aggregator.strategies.fedatt import FedAtt
from fedmq.aggregator.strategies.fedavgm import FedAvgM
from fedmq.aggregator.strategies.fedopt import FedAdam, FedOpt, FedYogi
from fedmq.aggregator.strategies.fedprox import FedProx, ProxHook
from fedmq.aggregator.strategies.scaffold import Scaffold
from fedmq.errors import BadParameter


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedOpt(server_lr=1e308),
        lambda: FedAdam(tau=1e-300),
        lambda: FedYogi(tau=1e308),
        lambda: FedAvgM(server_lr=1e308),
        lambda: Scaffold(server_lr=1e308),
        lambda: FedProx(mu=1e308),
        lambda: ProxHook(mu=1e308),
        lambda: BufferedAsync(server_lr=1e308),
        lambda: BufferedAsync(buffer_size=10**18),
        lambda: FedAtt(epsilon=1e308),
    ],
)
def test_absurd_finite_parameters_are_refused(make):
    with pytest.raises(BadParameter) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_usual_parameters_still_build():
    FedAdam(server_lr=1.0, tau=1e-9)
    FedAvgM(server_lr=10.0)
    Scaffold(server_lr=100.0)
    FedProx(mu=1.0)
    BufferedAsync(buffer_size=1000, server_lr=1.0)
    FedAtt(epsilon=10.0)
