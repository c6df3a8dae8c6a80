"""Atomic checkpoints: round trip, truncated/corrupt files skipped, pruning, no unpickling of foreign data."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from fedmq.aggregator.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from fedmq.aggregator.strategies.errors import CheckpointError


def save(tmp_path, r, value, **kw):
    py = random.Random(r)
    return save_checkpoint(
        tmp_path,
        round=r,
        model_version=r,
        global_state={"w": torch.full((3,), float(value)), "b": torch.zeros(2, dtype=torch.float16)},
        strategy_state={"generator": torch.Generator().manual_seed(r).get_state()},
        mediator_state={"previous_loss": 1.5, "history": [[1.5, "adaptive"]]},
        rng_state={"python": py.getstate(), "numpy": np.random.default_rng(r).bit_generator.state},
        folded={r: [f"u{r}a", f"u{r}b"]},
        extra={"note": "x", "nested": (1, [2.0, None])},
        **kw,
    )


def test_round_trip_restores_everything(tmp_path):
    save(tmp_path, 1, 1.0)
    ck = load_checkpoint(tmp_path)
    assert ck.round == 1 and ck.model_version == 1
    assert torch.equal(ck.global_state["w"], torch.ones(3)) and ck.global_state["b"].dtype == torch.float16
    assert ck.folded == {1: ["u1a", "u1b"]}
    assert ck.extra == {"note": "x", "nested": (1, [2.0, None])}
    assert ck.mediator_state["previous_loss"] == 1.5
    py = random.Random()
    py.setstate(ck.rng_state["python"])
    assert py.random() == random.Random(1).random()
    gen = np.random.default_rng()
    gen.bit_generator.state = ck.rng_state["numpy"]
    assert gen.random() == np.random.default_rng(1).random()
    g = torch.Generator()
    g.set_state(ck.strategy_state["generator"])
    assert torch.equal(
        torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(1))
    )


def test_truncated_latest_is_ignored_and_previous_loads(tmp_path):
    save(tmp_path, 1, 1.0)
    p2 = save(tmp_path, 2, 2.0)
    data = p2.read_bytes()
    p2.write_bytes(data[: len(data) // 2])
    ck = load_checkpoint(tmp_path)
    assert ck.round == 1 and torch.equal(ck.global_state["w"], torch.ones(3))
    with pytest.raises(CheckpointError, match="digest mismatch"):
        read_checkpoint(p2)


def test_corrupt_byte_and_empty_file_are_ignored(tmp_path):
    save(tmp_path, 1, 1.0)
    p2 = save(tmp_path, 2, 2.0)
    data = bytearray(p2.read_bytes())
    data[-100] ^= 0xFF
    p2.write_bytes(bytes(data))
    (tmp_path / "ckpt-00000003-00000003.fmq").write_bytes(b"")
    assert load_checkpoint(tmp_path).round == 1


def test_foreign_pickle_is_never_loaded(tmp_path):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    (tmp_path / "ckpt-00000009-00000009.fmq").write_bytes(pickle.dumps(Boom()))
    save(tmp_path, 1, 1.0)
    assert load_checkpoint(tmp_path).round == 1


def test_keeps_the_newest_n_and_ignores_temp_files(tmp_path):
    for r in range(1, 6):
        save(tmp_path, r, r, keep=2)
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"partial write of a crashed save")
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.fmq"))
    assert names == ["ckpt-00000004-00000004.fmq", "ckpt-00000005-00000005.fmq"]
    assert load_checkpoint(tmp_path).round == 5


def test_a_checkpoint_is_readable_by_its_owner_only(tmp_path):
    assert save(tmp_path, 1, 1.0).stat().st_mode & 0o777 == 0o600


def test_empty_or_missing_directory_gives_none(tmp_path):
    assert load_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path / "nope") is None


def test_unsupported_state_is_a_typed_error_and_writes_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="cannot checkpoint a value of type set"):
        save_checkpoint(
            tmp_path,
            round=1,
            model_version=1,
            global_state={},
            strategy_state={"s": {1, 2}},
            mediator_state={},
            rng_state=None,
            folded={},
            extra={},
        )
    assert list(tmp_path.iterdir()) == []


def test_kill_9_during_saves_leaves_a_loadable_checkpoint(tmp_path):
    """A writer saving 4 MB checkpoints in a loop is SIGKILLed at three points; every time the newest
    surviving checkpoint loads and its contents match its round."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "from fedmq.aggregator.checkpoint import save_checkpoint\n"
        "r = 0\n"
        "while True:\n"
        "    r += 1\n"
        f"    save_checkpoint({str(tmp_path)!r}, round=r, model_version=r, "
        "global_state={'w': torch.full((1_000_000,), float(r))},\n"
        "                    strategy_state={}, mediator_state={}, rng_state=None, folded={r: ['u']}, "
        "extra={})\n"
        "    print(r, flush=True)\n"
    )
    for delay in (0.05, 0.3, 0.7):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # at least one checkpoint exists
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        ck = load_checkpoint(tmp_path)
        assert ck is not None and ck.folded == {ck.round: ["u"]}
        assert torch.equal(ck.global_state["w"], torch.full((1_000_000,), float(ck.round)))


def test_a_prepared_checkpoint_keeps_the_strategy_state_as_it_was_when_taken(tmp_path):
    """A strategy of one's own may update its state in place while the checkpoint is being written."""
    from fedmq.aggregator.checkpoint import prepare_checkpoint

    momentum = torch.zeros(3)
    prepared = prepare_checkpoint(
        tmp_path,
        round=2,
        model_version=1,
        global_state={"w": torch.ones(3)},
        strategy_state={"mine": {"m": momentum}},
        mediator_state={},
        rng_state=None,
        folded={},
        extra={},
    )
    momentum.add_(5)  # the next round's step, before the write
    prepared.write()
    assert torch.equal(load_checkpoint(tmp_path).strategy_state["mine"]["m"], torch.zeros(3))
