"""Small runs on the real corpora in $FEDMQ_DATA_DIR (skipped without them): local training lowers
validation perplexity and raises BLEU.

First few thousand lines, tiny models, one thread; each case stays well under a minute on a busy 2-core
machine.
"""

from __future__ import annotations

import math

import pytest

from fedmq.tasks.base import TrainConfig
from fedmq.tasks.registry import make_task

pytestmark = pytest.mark.slow


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("corpus,max_lines", [("wikitext-2", 1200), ("ptb", 2500)])
def test_lm_training_lowers_validation_perplexity(real_corpus, corpus, max_lines):
    task = make_task(
        "lm",
        data=str(real_corpus(corpus)),
        model="gru-small",
        emb=64,
        hidden=64,
        clients=2,
        vocab_size=5000,
        max_lines=max_lines,
        max_eval_lines=300,
        bptt=20,
        dropout=0.0,
        seed=0,
    )
    model = task.build_model(0)
    before = task.evaluate(model, "valid")
    # the cap and the minimum count both apply: words seen once are <unk>, at most 5000 words
    assert 3000 < len(task.vocab) <= 5000 and task.vocab.unk in task.client_ids(0).tolist()
    # untrained: about uniform over the vocabulary
    assert 0.8 * len(task.vocab) < before < 1.2 * len(task.vocab)
    losses = []
    for client in range(2):  # both shards, one local epoch each: the whole capped training split once
        res = task.train(model, client, TrainConfig(epochs=1, batch_size=20, lr=20.0, clip=0.25, seed=0))
        assert math.isfinite(res.loss) and res.n_samples == task.client_ids(client).numel()
        losses.append(res.loss)
    after = task.evaluate(model, "valid")
    assert after < 0.15 * before, (before, after)
    assert losses[1] < losses[0]


def test_nmt_training_raises_bleu(real_corpus, tmp_path):
    task = make_task(
        "nmt",
        data=str(real_corpus("de-en")),
        domains="captions_multi30k",
        model="tiny",
        max_lines=2500,
        vocab_size=2000,
        eval_max_sentences=100,
        cache_dir=str(tmp_path / "cache"),
        seed=0,
    )
    model = task.build_model(0)
    before = task.evaluate(model, "valid")
    cfg = TrainConfig(epochs=4, batch_size=32, lr=3e-3, optimizer="adam", clip=1.0, seed=0)
    res = task.train(model, 0, cfg)
    after = task.evaluate(model, "valid")
    assert res.n_samples == 2250 and math.isfinite(res.loss)
    assert before < 1.0 and after > before + 3.0, (before, after)
