"""What a grid of the experiments is made of (RunSpec), and the settings every grid shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedmq.errors import FedmqError
from fedmq.tasks.corpora import corpus_dir

SCALES = ("smoke", "cpu", "paper")


class ExperimentError(FedmqError):
    pass


@dataclass
class RunSpec:
    """One federation of an experiment's grid."""

    name: str  # run folder name
    task: str  # "lm" | "nmt"
    task_options: dict[str, Any]
    job: dict[str, Any]  # JobConfig keyword arguments
    labels: dict[str, Any] = field(default_factory=dict)  # columns of the results table
    availability: str = "always"
    faults: str = ""
    central: bool = False  # no federation: the centralized baseline (Runner.centralize)


DEADLINES = dict(report_deadline_s=120.0, update_deadline_s=120.0, join_timeout_s=60.0, heartbeat_s=1.0)
# the grids' clients' lr follows their own schedule (round_lr_decay), as their archived runs did: no annealing
# on validation, whatever fedmq simulate's default
SCHEDULE = dict(lr_anneal=1.0)


def corpus_folder(name: str) -> str:
    """The folder of a corpus in the data folder ($FEDMQ_DATA_DIR, fedmq.tasks.corpora); ``check_corpora``
    checks that it is there."""
    return str(corpus_dir(name))
