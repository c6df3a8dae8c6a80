"""The language model's minimum word count (``min_count``, ``--min-count``): training words seen fewer times
are ``<unk>``, so ``<unk>`` is a training target; it composes with ``vocab_size``; bad values are one line;
the flag and the job file's ``[task]`` table reach the task; a run from before the option resumes with the
vocabulary it was built with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fedmq_procs
import pytest

from fedmq.tasks.catalog import MIN_COUNT
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm import LanguageModelTask
from fedmq.tasks.lm_data import EOS, UNK, Vocabulary
from fedmq.tasks.registry import make_task

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(emb=8, hidden=8, dropout=0.0, bptt=4, clients=2)
# counts: the 4, cat 3, sat 2, on 2, mat 1, dog 1 (first seen in that order within a count)
LINES = [["the", "cat", "sat", "on", "the", "mat"], ["the", "cat", "sat"], ["on", "the", "dog"], ["cat"]]


@pytest.fixture
def corpus_dir(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(" ".join(line) for line in LINES) + "\n")
    (tmp_path / "valid.txt").write_text("the cat sat on the mat\n")
    (tmp_path / "test.txt").write_text("a dog sat on the zebra\n")
    return tmp_path


def test_words_seen_fewer_than_min_count_times_are_unk():
    assert Vocabulary.build(LINES).itos == [EOS, UNK, "the", "cat", "sat", "on", "mat", "dog"]
    assert Vocabulary.build(LINES, min_count=2).itos == [EOS, UNK, "the", "cat", "sat", "on"]
    assert Vocabulary.build(LINES, min_count=3).itos == [EOS, UNK, "the", "cat"]
    vocab = Vocabulary.build(LINES, min_count=2)
    ids = vocab.encode_lines([["the", "mat", "dog", "zebra"]]).tolist()
    assert ids == [vocab.stoi["the"], vocab.unk, vocab.unk, vocab.unk, vocab.eos]


def test_min_count_and_vocab_size_both_apply():
    # the cap is tighter than the count: the commonest words that pass the count
    assert Vocabulary.build(LINES, max_size=4, min_count=2).itos == [EOS, UNK, "the", "cat"]
    # the count is tighter than the cap: the cap keeps what is left
    assert Vocabulary.build(LINES, max_size=7, min_count=3).itos == [EOS, UNK, "the", "cat"]
    assert len(Vocabulary.build(LINES, max_size=7)) == 7


def test_unk_is_a_training_target_by_default_and_not_with_min_count_1(corpus_dir):
    assert MIN_COUNT >= 2
    task = LanguageModelTask(corpus_dir, model="gru-small", **TINY)
    assert task.min_count == MIN_COUNT and task.describe()["min_count"] == MIN_COUNT
    train = [int(i) for c in range(task.num_clients) for i in task.client_ids(c)]
    # "mat" and "dog" (seen once) are <unk> targets in the clients' streams
    assert train.count(task.vocab.unk) == 2 and "mat" not in task.vocab.stoi
    whole = LanguageModelTask(corpus_dir, model="gru-small", min_count=1, **TINY)
    train = [int(i) for c in range(whole.num_clients) for i in whole.client_ids(c)]
    assert whole.vocab.unk not in train and len(whole.vocab) == 8


@pytest.mark.parametrize(
    "value,needle",
    [
        (0, "min_count (--min-count) must be at least 1, got 0"),
        (-3, "min_count (--min-count) must be at least 1, got -3"),
        ("2", "min_count (--min-count) must be a whole number, got '2'"),
        (True, "min_count (--min-count) must be a whole number, got True"),
        (5, "min_count (--min-count) is 5 but no training word occurs that often (the commonest: 4 times)"),
    ],
)
def test_bad_min_count_is_one_line(corpus_dir, value, needle):
    with pytest.raises(TaskError) as info:
        make_task("lm", data=str(corpus_dir), model="gru-small", min_count=value, **TINY)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_nmt_ignores_min_count_from_a_shared_flag_set():
    from fedmq.tasks.catalog import LM_ONLY

    assert "min_count" in LM_ONLY


def _fedmq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return fedmq_procs.fedmq(*args, timeout=timeout)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--min-count", "0"], "--min-count must be at least 1, got 0"),
        (["--min-count", "x"], "--min-count"),
        (
            ["--task", "nmt", "--data", ".", "--min-count", "3"],
            "--min-count: lm option(s), not used by --task nmt",
        ),
    ],
)
def test_bad_min_count_flags_are_one_line_before_torch(tmp_path, args, needle):
    out = tmp_path / "run"
    code = (
        "import atexit, sys; "
        "atexit.register(lambda: sys.__stdout__.write('TORCH=%s' % ('torch' in sys.modules)));"
        f"sys.argv = ['fedmq', 'simulate', *{args!r}, '--out', {str(out)!r}]; "
        "from fedmq.cli.app import main; main()"
    )
    proc = fedmq_procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert "TORCH=False" in proc.stdout and not out.exists()


def test_simulate_builds_the_vocabulary_the_flag_and_the_job_file_ask_for(corpus_dir, tmp_path):
    common = ["--data", str(corpus_dir), "-k", "2", "-c", "1", "-r", "1", "--bptt", "4", "--max-steps", "2"]
    job = tmp_path / "job.toml"
    job.write_text("[task]\nmin_count = 3\n")
    runs = {"flags": ["--min-count", "2", "--vocab-size", "5"], "file": ["--config", str(job)]}
    for name, args in runs.items():
        proc = _fedmq("simulate", *common, *args, "--out", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
    config = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in runs}
    got = {
        name: (c["min_count"], c["vocab_size"], c["extra"]["cli"]["min_count"]) for name, c in config.items()
    }
    # <eos>, <unk> and: the, cat, sat (of the, cat, sat, on: capped at 5) | the, cat
    assert got == {"flags": (2, 5, 2), "file": (3, 4, 3)}


def test_a_run_from_before_min_count_resumes_with_every_word():
    import typer

    from fedmq.cli.app import app
    from fedmq.cli.commands.simulate import simulate
    from fedmq.cli.errors import UsageError
    from fedmq.cli.simulate_options import from_context, saved_options

    def plan(*args: str, saved: dict | None = None):
        ctx = typer.main.get_command(app).commands["simulate"].make_context("simulate", list(args))
        return from_context(ctx, simulate, saved)

    recorded = dict(plan("-k", "4").options)
    del recorded["min_count"]
    old = saved_options({"extra": {"cli": recorded}})
    assert plan(saved=old).task["min_count"] == 1
    with pytest.raises(UsageError, match=r"--min-count 2 \(saved: 1\)"):
        plan("--min-count", "2", saved=old)
    legacy = {"strategy": "fedavg", "clients": 4, "task": "lm", "model": "gru-small", "extra": {}}
    assert plan(saved=saved_options(legacy)).task["min_count"] == 1
    assert plan(saved=saved_options({**legacy, "min_count": 3})).task["min_count"] == 3
    assert plan().task["min_count"] == MIN_COUNT


@pytest.mark.parametrize("scale", ["paper", "cpu", "smoke"])
def test_every_lm_cell_of_the_experiment_grids_keeps_every_training_word(scale):
    """The archived results were made before the minimum count: their cells build the vocabulary they had."""
    from fedmq.benchmarks.experiments import grids

    cells = [s for name in grids.EXPERIMENTS for s in grids.grid(name, scale) if s.task == "lm"]
    assert len(cells) > 10
    assert {s.task_options.get("min_count") for s in cells} == {1}
