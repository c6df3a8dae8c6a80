"""The decayed learning rate reaches the agents: each round's training runs at lr × round_lr_decay^(r−1)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import fedmq

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "bring_your_own.py"


def test_agents_train_at_the_rounds_decayed_learning_rate(tmp_path):
    spec = importlib.util.spec_from_file_location("byo_lr_decay", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["byo_lr_decay"] = example
    try:
        spec.loader.exec_module(example)
        seen: list[tuple[int, float]] = []

        class Recording(example.TwoMoons):
            def train(self, model, client, cfg, progress=None):
                seen.append((client, cfg.lr))
                return super().train(model, client, cfg, progress)

        cfg = fedmq.JobConfig(
            job="lrdecay",
            strategy="fedavg",
            rounds=3,
            clients=2,
            fraction=1.0,
            lr=0.8,
            round_lr_decay=0.5,
            batch_size=16,
            heartbeat_s=1.0,
        )
        summary = fedmq.Simulation(cfg, Recording(clients=2), run_dir=tmp_path / "run").run()
    finally:
        del sys.modules["byo_lr_decay"]
    assert summary["rounds_completed"] == 3
    assert sorted({lr for _, lr in seen}, reverse=True) == [0.8, 0.4, 0.2] and len(seen) == 6
