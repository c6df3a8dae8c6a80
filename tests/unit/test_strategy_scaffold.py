import logging

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.strategies import scaffold
from fedmq.aggregator.strategies.registry import strategy_from_config


def test_unmet_plain_sgd_assumption_is_said_once(caplog):
    scaffold._said.clear()
    with caplog.at_level(logging.WARNING, logger=scaffold.__name__):
        for _ in range(3):  # a strategy is built every round
            strategy_from_config("scaffold", JobConfig(strategy="scaffold", clients=4))
    said = [r.getMessage() for r in caplog.records if r.name == scaffold.__name__]
    assert len(said) == 1 and "clip 0.25" in said[0] and "plain SGD" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=scaffold.__name__):
        strategy_from_config("scaffold", JobConfig(strategy="scaffold", clients=4, clip=0.0))
    assert not [r for r in caplog.records if r.name == scaffold.__name__]
    assert scaffold.unmet_assumption(JobConfig(clip=0.0, momentum=0.5)) == "momentum 0.5"
