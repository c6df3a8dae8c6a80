"""Language-modelling task: corpora, vocabulary, batching, models, perplexity by hand, determinism, errors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

from fedmq.tasks.base import TrainConfig, load_state, model_state
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm import LanguageModelTask, detach_hidden
from fedmq.tasks.lm_data import EOS, UNK, StreamBatches, Vocabulary, load_corpus
from fedmq.tasks.lm_models import RNNLanguageModel, rnn_config
from fedmq.tasks.registry import make_task

TINY = dict(emb=16, hidden=16, dropout=0.0, bptt=8)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def corpus_dir(tmp_path):
    words = "the cat sat on a mat while the dog ran to the park and a bird sang".split()
    rng = torch.Generator().manual_seed(0)
    for split, n in (("train", 200), ("valid", 23), ("test", 17)):
        lines = []
        for _ in range(n):
            k = int(torch.randint(3, 9, (1,), generator=rng))
            lines.append(" ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=rng)))
        if split == "valid":
            lines[0] += " zebra"  # out of the training vocabulary
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_vocabulary_from_train_only_with_cap(corpus_dir):
    corpus = load_corpus(corpus_dir)
    vocab = Vocabulary.build(corpus.lines["train"])
    assert vocab.itos[:2] == [EOS, UNK] and "zebra" not in vocab.stoi
    assert vocab.itos[2] == "the"  # most frequent word first
    capped = Vocabulary.build(corpus.lines["train"], max_size=5)
    assert len(capped) == 5
    ids = capped.encode_lines([["the", "zebra", "bird"]])
    assert (
        ids.tolist()[0] == capped.stoi["the"]
        and ids.tolist()[1] == capped.unk
        and ids.tolist()[-1] == capped.eos
    )


def test_stream_batches_cover_every_token_once():
    ids = torch.arange(2, 25)  # 23 tokens, 10 columns -> padded last column
    b = StreamBatches.build(ids, cols=10, eos=0)
    assert b.n_targets == 23 and int(b.mask.sum()) == 23
    targets = b.targets.t().reshape(-1)[b.mask.t().reshape(-1)]
    assert targets.tolist() == ids.tolist()
    inputs = b.inputs.t().reshape(-1)[b.mask.t().reshape(-1)]
    assert inputs.tolist() == [0] + ids.tolist()[:-1]  # each target's input is the previous token
    windows = list(b.windows(2))
    assert len(windows) == b.num_windows(2) == 2 and windows[-1][0].size(0) == 1


def test_presets_shapes_and_tied_weights():
    v = 50
    for name, emb, hid, layers in [
        ("gru-small", 300, 300, 1),
        ("gru-medium", 650, 650, 1),
        ("lstm", 300, 400, 2),
    ]:
        cfg = rnn_config(name, tied=None)
        assert (cfg.emb, cfg.hidden, cfg.layers) == (emb, hid, layers)
    cfg = rnn_config("gru-large")
    assert (cfg.emb, cfg.hidden, cfg.cell, cfg.tied) == (1500, 1500, "gru", True)
    model = RNNLanguageModel(v, rnn_config("gru-small", tied=True), seed=0)
    assert model.decoder.weight is model.encoder.weight
    state = model_state(model)
    assert "encoder.weight" in state and "decoder.weight" not in state
    assert state["encoder.weight"].shape == (v, 300)
    logits, hidden = model(torch.zeros(7, 3, dtype=torch.long), model.init_hidden(3))
    assert logits.shape == (7, 3, v) and hidden[0].shape == (1, 3, 300)
    untied = RNNLanguageModel(v, rnn_config("lstm"), seed=0)
    s = model_state(untied)
    assert s["decoder.weight"].shape == (v, 400) and s["encoder.weight"].shape == (v, 300)
    assert sorted(k for k in s if k.startswith("rnn.")) == sorted(
        f"rnn.{i}.{w}_{t}_l0" for i in (0, 1) for w in ("weight", "bias") for t in ("ih", "hh")
    )
    assert s["rnn.1.weight_ih_l0"].shape == (4 * 400, 400)
    logits, hidden = untied(torch.zeros(4, 2, dtype=torch.long), untied.init_hidden(2))
    assert logits.shape == (4, 2, v) and len(hidden) == 2 and hidden[1][0].shape == (1, 2, 400)
    # no buffers: the federated state is the whole model
    assert not list(model.buffers()) and not list(untied.buffers())


def test_load_state_into_tied_model_updates_both_ends():
    a = RNNLanguageModel(20, rnn_config("gru-small", emb=8, hidden=8), seed=1)
    b = RNNLanguageModel(20, rnn_config("gru-small", emb=8, hidden=8), seed=2)
    load_state(b, model_state(a))
    assert torch.equal(b.decoder.weight, a.encoder.weight)
    assert all(torch.equal(x, y) for x, y in zip(model_state(a).values(), model_state(b).values()))


class FixedDistribution(nn.Module):
    """Predicts the same distribution p over the vocabulary at every position."""

    def __init__(self, p: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(p.log())

    def init_hidden(self, batch, device="cpu"):
        return []

    def forward(self, x, hidden):
        return self.logits.expand(*x.shape, -1), hidden


def test_perplexity_of_a_fixed_distribution_by_hand(corpus_dir):
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=2, **TINY)
    v = len(task.vocab)
    p = torch.arange(1, v + 1, dtype=torch.float64)
    p = (p / p.sum()).float()
    ids = task.vocab.encode_lines(
        task.corpus.lines["valid"]
    )  # 23 lines, every token incl. each <eos> is a target
    counts = Counter(ids.tolist())
    expected = math.exp(-sum(c * math.log(float(p[t])) for t, c in counts.items()) / len(ids))
    got = task.evaluate(FixedDistribution(p), "valid")
    assert got == pytest.approx(expected, rel=1e-5)
    # uniform distribution: perplexity = vocabulary size exactly
    assert task.evaluate(FixedDistribution(torch.full((v,), 1.0 / v)), "test") == pytest.approx(v, rel=1e-5)


def test_a_diverged_model_scores_infinite_perplexity(corpus_dir):
    """A mean NLL past exp's range (a federation whose lr diverged) is perplexity inf, not an OverflowError
    that stops the aggregator (seen at lr 4 on the GPU)."""
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=2, **TINY)
    v = len(task.vocab)
    model = FixedDistribution(torch.full((v,), 1.0 / v, dtype=torch.float64))
    with torch.no_grad():
        model.logits[
            1:
        ] = -2000.0  # every token but the first at log-probability ≈ -2000: far past exp's range
    assert task.mean_nll(model, "valid") > 710 and task.evaluate(model, "valid") == math.inf


def test_client_shards_and_n_samples(corpus_dir):
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=4, seed=1, **TINY)
    assert task.num_clients == 4
    lines = sorted(i for s in task.shards for i in s.tolist())
    assert lines == list(range(200))
    n = sum(int(task.client_ids(c).numel()) for c in range(4))
    assert n == sum(len(line) + 1 for line in task.corpus.lines["train"])  # every training token once
    res = task.train(task.build_model(0), 2, TrainConfig(batch_size=4, lr=1.0, max_steps=3))
    assert res.n_samples == task.client_ids(2).numel() and res.steps == 3 and res.tokens > 0


def test_training_deterministic_for_a_seed_and_lowers_loss(corpus_dir):
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=1, emb=16, hidden=16, dropout=0.3, bptt=8)
    cfg = TrainConfig(
        epochs=2, batch_size=5, lr=2.0, momentum=0.5, optimizer="sgd", lr_decay=0.5, clip=0.5, seed=7
    )
    a, b, c = task.build_model(3), task.build_model(3), task.build_model(3)
    before = task.mean_nll(a, "train")
    calls = []
    ra = task.train(a, 0, cfg, progress=lambda d, t: calls.append((d, t)))
    rb = task.train(b, 0, cfg)
    task.train(c, 0, TrainConfig(**{**vars(cfg), "seed": 8}))
    assert ra.loss == rb.loss and ra.steps == rb.steps
    assert all(torch.equal(x, y) for x, y in zip(model_state(a).values(), model_state(b).values()))
    assert not all(
        torch.equal(x, y) for x, y in zip(model_state(a).values(), model_state(c).values())
    )  # dropout masks
    assert calls[-1] == (ra.steps, ra.steps) and len(calls) == ra.steps
    # random word salad: the entropy floor is close to log(16) = 2.77, so the gain is small but certain
    assert task.mean_nll(a, "train") < before - 0.2


def test_adam_and_max_steps(corpus_dir):
    task = LanguageModelTask(
        corpus_dir, model="lstm", tied=False, clients=1, emb=8, hidden=12, dropout=0.1, bptt=8
    )
    model = task.build_model(0)
    res = task.train(model, 0, TrainConfig(epochs=5, batch_size=4, lr=0.01, optimizer="adam", max_steps=4))
    assert res.steps == 4 and math.isfinite(res.loss)


def test_capped_runs_start_at_a_seeded_window(corpus_dir):
    """With max_steps, the round's seed picks where in the shard the run starts (later rounds see the rest);
    a full epoch is the whole shard in order whatever the seed (no dropout here, so the losses are equal)."""
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=1, **TINY)

    def loss(seed: int, max_steps: int) -> float:
        return task.train(
            task.build_model(0), 0, TrainConfig(batch_size=4, lr=1.0, seed=seed, max_steps=max_steps)
        ).loss

    assert loss(1, 0) == loss(2, 0)
    capped = {loss(seed, 1) for seed in range(1, 6)}
    assert len(capped) > 1  # different first windows
    assert loss(3, 1) == loss(3, 1)  # still deterministic for a seed


def test_builtin_corpus_works_without_files():
    task = make_task(
        "lm",
        data="builtin",
        model="gru-small",
        emb=8,
        hidden=8,
        clients=10,
        vocab_size=1000,
        max_lines=2000,
        max_eval_lines=100,
        bptt=10,
    )
    d = task.describe()
    assert d["corpus"] == "builtin" and d["vocab_size"] == 1000 and d["train_lines"] == 2000
    full = load_corpus("builtin")
    n_train, n_valid, n_test = (len(full.lines[s]) for s in ("train", "valid", "test"))
    assert n_train > 5000 and 0.04 < n_valid / (n_train + n_valid + n_test) < 0.06 and n_valid == n_test
    assert full.lines["train"][:50] == load_corpus("builtin").lines["train"][:50]  # deterministic
    ppl = task.evaluate(task.build_model(0))
    assert 500 < ppl < 2000  # an untrained model is near-uniform over the 1000 words


def test_natural_partition_by_docid(corpus_dir):
    (corpus_dir / "train.docid").write_text("".join(f"doc{i % 3}\n" for i in range(200)))
    task = LanguageModelTask(corpus_dir, model="gru-small", partition="natural", **TINY)
    assert task.num_clients == 3 and all(
        set(s.tolist()) == set(range(k, 200, 3)) for k, s in enumerate(task.shards)
    )
    (corpus_dir / "train.docid").write_text("doc\n")
    with pytest.raises(TaskError, match="one id per line"):
        LanguageModelTask(corpus_dir, model="gru-small", partition="natural", **TINY)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(model="gru-huge"), "unknown LM model"),
        (dict(model="lstm", tied=True, hidden=24), "use --untied"),
        (dict(data="/does/not/exist"), "no such folder"),
        (dict(dropout=1.5), "dropout"),
        (dict(bptt=0), "bptt"),
        (dict(vocab_size=2), "vocab-size"),
        (dict(partition="natural"), "needs documents"),
        (dict(clients=10**6), r"a token each: .*lower clients \(--clients\)"),
        (dict(clients="8"), "whole number"),
        (dict(colour="red"), "no option colour"),
    ],
)
def test_bad_options_raise_one_line_task_errors(corpus_dir, options, match):
    opts = dict(data=str(corpus_dir), model="gru-small", clients=2, **TINY)
    opts.update(options)
    with pytest.raises(TaskError, match=match) as info:
        make_task("lm", **opts)
    assert "\n" not in str(info.value)


def test_more_clients_than_lines_split_the_shuffled_token_stream(corpus_dir):
    """A population past the corpus's lines (a cross-device study): each client holds a few words, the
    clients' words together are every training word once, and the split is seeded."""
    few = make_task("lm", data=str(corpus_dir), model="gru-small", clients=2, **TINY)
    lines = len(few.corpus.lines["train"])
    k = lines * 3
    task = make_task("lm", data=str(corpus_dir), model="gru-small", clients=k, **TINY)
    parts = [task.client_ids(c) for c in range(k)]
    assert task.num_clients == k and min(len(p) for p in parts) >= 1
    stream = torch.cat(parts)
    every = task.vocab.encode_lines(task.corpus.lines["train"])
    assert len(stream) == len(every) and sorted(stream.tolist()) == sorted(every.tolist())
    again = make_task("lm", data=str(corpus_dir), model="gru-small", clients=k, **TINY)
    assert torch.equal(torch.cat([again.client_ids(c) for c in range(k)]), stream)


def test_folder_without_corpus_files(tmp_path):
    (tmp_path / "train.txt").write_text("a b\n")
    with pytest.raises(TaskError, match="train.txt/valid.txt/test.txt"):
        make_task("lm", data=str(tmp_path))
    with pytest.raises(TaskError, match="unknown task"):
        make_task("speech")


def test_bad_train_config(corpus_dir):
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=1, **TINY)
    model = task.build_model(0)
    before = [t.clone() for t in model_state(model).values()]
    for cfg, match in [
        (TrainConfig(optimizer="rmsprop"), "optimizer"),
        (TrainConfig(device="tpu"), "device"),
        (TrainConfig(epochs=0), "epochs"),
        (TrainConfig(lr=-1), "lr"),
    ]:
        with pytest.raises(TaskError, match=match):
            task.train(model, 0, cfg)
    with pytest.raises(TaskError, match="does not exist"):
        task.train(model, 5, TrainConfig())
    assert all(torch.equal(a, b) for a, b in zip(before, model_state(model).values()))  # nothing changed


def test_data_names_a_cached_corpus_or_says_where_to_put_it(tmp_path, monkeypatch, corpus_dir):
    """`--data wikitext-2` reads $FEDMQ_DATA_DIR/wikitext-2;
    a missing corpus or a file gets one line saying what to do."""
    from fedmq.tasks.corpora import resolve

    monkeypatch.setenv("FEDMQ_DATA_DIR", str(tmp_path / "cache"))
    with pytest.raises(
        TaskError, match=r"corpus 'ptb' is not on this machine: put its folder .* at .*cache/ptb"
    ) as info:
        make_task("lm", data="ptb", clients=2, **TINY)
    assert "\n" not in str(info.value)
    cached = tmp_path / "cache" / "ptb"
    cached.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (cached / f"ptb.{split}.txt").write_text((corpus_dir / f"{split}.txt").read_text())
    assert resolve("ptb") == str(cached)
    task = make_task("lm", data="ptb", model="gru-small", clients=2, **TINY)
    assert task.num_clients == 2
    a_file = cached / "ptb.train.txt"
    with pytest.raises(TaskError, match=f"is a file; pass the folder that holds the corpus \\({cached}\\)"):
        make_task("lm", data=str(a_file), clients=2, **TINY)


def test_full_batch_is_one_step_on_the_whole_shard_gradient(corpus_dir):
    """FedSGD (B = ∞): one optimizer step per epoch on the token-weighted mean gradient of every batch."""
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=2, **{**TINY, "bptt": 4})
    base = model_state(task.build_model(0))
    cfg = dict(lr=0.5, clip=0.0, batch_size=4, seed=3)

    sgd = task.build_model(0)
    per_batch = task.train(sgd, 0, TrainConfig(**cfg))
    full = task.build_model(0)
    result = task.train(full, 0, TrainConfig(**cfg, full_batch=True))
    assert per_batch.steps > 1 and result.steps == 1 and result.tokens == per_batch.tokens

    # the same step by hand: the mean loss over all targets, one backward, θ − lr·∇
    manual = task.build_model(0)
    load_state(manual, base)
    grads = {n: torch.zeros_like(p) for n, p in manual.named_parameters()}
    hidden, total = None, 0
    batches = StreamBatches.build(task.client_ids(0), 4, task.vocab.eos)
    manual.train()
    hidden = manual.init_hidden(batches.inputs.size(1), torch.device("cpu"))
    for x, y, mask in batches.windows(4):
        hidden = detach_hidden(hidden)
        logits, hidden = manual(x, hidden)
        nll = nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none"
        )
        manual.zero_grad()
        (nll * mask.reshape(-1)).sum().backward()
        for n, p in manual.named_parameters():
            grads[n] += p.grad
        total += int(mask.sum())
    expected = {n: base[n] - 0.5 * g / total for n, g in grads.items()}
    got = dict(full.named_parameters())
    for n in expected:
        assert torch.allclose(got[n].detach(), expected[n], atol=1e-6), n
    assert not all(torch.equal(a, b) for a, b in zip(model_state(sgd).values(), model_state(full).values()))


def test_tail_loss_is_the_trained_models_loss_on_its_shard(corpus_dir):
    """FedMed §3.4 ranks workers by "the loss on the dataset of each worker ... computed at the tail of local
    training": the trained model on its own shard, not the running mean over the run (which lags behind)."""
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=1, emb=16, hidden=16, dropout=0.3, bptt=8)
    cfg = dict(epochs=2, batch_size=5, lr=2.0, momentum=0.5, optimizer="sgd", seed=7)
    plain, tailed = task.build_model(3), task.build_model(3)
    r_plain = task.train(plain, 0, TrainConfig(**cfg))
    r_tail = task.train(tailed, 0, TrainConfig(**cfg, tail_loss=True))
    assert r_plain.tail_loss is None and r_plain.reported == r_plain.loss
    # measuring it changes nothing else: the same model, the same running loss
    assert r_tail.loss == r_plain.loss
    assert all(torch.equal(x, y) for x, y in zip(model_state(plain).values(), model_state(tailed).values()))
    # it is the trained model's loss on the shard (clients=1: the whole train split), dropout off
    assert r_tail.reported == r_tail.tail_loss == pytest.approx(task.mean_nll(tailed, "train"), rel=0.03)
    assert r_tail.tail_loss < r_tail.loss  # the model learned during the run: its end is below the run's mean


def test_fedmed_rounds_ask_for_the_tail_loss_and_others_do_not():
    from fedmq.aggregator.config import JobConfig

    assert JobConfig(strategy="fedmed").train_config().tail_loss is True
    assert JobConfig(strategy="fedavg").train_config().tail_loss is False


def test_full_batch_step_covers_the_same_targets_whatever_the_stream_count(corpus_dir):
    """The paper scale's FedSGD cuts a shard into more streams (benchmarks PAPER_FEDSGD_STREAMS): still one
    step on every target of the shard, and the mean loss differs only where a stream's hidden state starts at
    zero."""
    task = LanguageModelTask(corpus_dir, model="gru-small", clients=2, **{**TINY, "bptt": 4})
    cfg = dict(lr=0.5, clip=0.0, seed=3, full_batch=True)
    few = task.train(task.build_model(0), 0, TrainConfig(**cfg, batch_size=2))
    many = task.train(task.build_model(0), 0, TrainConfig(**cfg, batch_size=16))
    assert few.steps == many.steps == 1
    assert few.tokens == many.tokens == few.n_samples == many.n_samples == len(task.client_ids(0))
    assert many.loss == pytest.approx(few.loss, rel=0.02) and many.loss != few.loss


def test_natural_partition_refuses_a_client_count_it_would_not_honour(corpus_dir):
    """--partition natural makes one client per document: a different --clients is one line, never ignored."""
    (corpus_dir / "train.docid").write_text("".join(f"doc{i % 3}\n" for i in range(200)))
    assert LanguageModelTask(corpus_dir, partition="natural", clients=3, **TINY).num_clients == 3
    with pytest.raises(TaskError, match=r"one client per document \(3 here\) but clients \(--clients\) is 8"):
        LanguageModelTask(corpus_dir, partition="natural", clients=8, **TINY)
