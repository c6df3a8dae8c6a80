"""Translation task: parallel data, shared BPE, Transformer shapes/groups, decoding,
BLEU via sacrebleu, errors."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.tasks.base import TrainConfig, model_state
from fedmq.tasks.errors import TaskError
from fedmq.tasks.nmt import TranslationTask, corpus_bleu
from fedmq.tasks.nmt_data import BOS, EOS, PAD, pad
from fedmq.tasks.nmt_decode import beam_search, greedy
from fedmq.tasks.nmt_model import TransformerNMT, transformer_config
from fedmq.tasks.registry import make_task

DE = ["ein hund", "eine katze", "der mann", "die frau", "ein kind", "das haus", "ein auto", "der baum"]
EN = ["a dog", "a cat", "the man", "the woman", "a child", "the house", "a car", "the tree"]
VERBS = [("läuft", "runs"), ("schläft", "sleeps"), ("isst", "eats"), ("spielt", "plays")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write_domain(folder, n, offset=0, docids=False):
    folder.mkdir(parents=True, exist_ok=True)
    de, en, doc = [], [], []
    for i in range(n):
        j = (i + offset) % len(DE)
        v = (i // len(DE) + offset) % len(VERBS)
        de.append(f"{DE[j]} {VERBS[v][0]} .")
        en.append(f"{EN[j].capitalize()} {VERBS[v][1]}.")
        doc.append(f"movie{i % 3}")
    (folder / "corpus.de").write_text("\n".join(de) + "\n")
    (folder / "corpus.en").write_text("\n".join(en) + "\n")
    if docids:
        (folder / "corpus.docid").write_text("\n".join(doc) + "\n")


@pytest.fixture
def de_en(tmp_path):
    _write_domain(tmp_path / "de-en" / "news", 120)
    _write_domain(tmp_path / "de-en" / "subs", 90, offset=3, docids=True)
    return tmp_path / "de-en"


def _task(de_en, tmp_path, **kw):
    opts = dict(
        model="tiny", vocab_size=60, cache_dir=tmp_path / "cache", eval_fraction=0.1, eval_max_sentences=0
    )
    opts.update(kw)
    return TranslationTask(de_en, **opts)


def test_bleu_through_sacrebleu_on_known_strings():
    assert corpus_bleu(["The cat sat on the mat."], ["The cat sat on the mat."]) == pytest.approx(100.0)
    # one substituted word in six: precisions 5/6, 4/5, 3/4, 2/3, no brevity penalty
    expected = 100 * (5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25
    assert corpus_bleu(["the cat sat on the rug"], ["the cat sat on the mat"]) == pytest.approx(
        expected, rel=1e-6
    )
    # a hypothesis half as long: brevity penalty exp(1 - 6/3) on perfect precisions
    assert corpus_bleu(["the cat sat on"], ["the cat sat on the mat all day"]) == pytest.approx(
        100 * math.exp(-1), rel=1e-6
    )
    assert corpus_bleu(["xyz"], ["the cat sat on the mat"]) == pytest.approx(0.0)


def test_splits_domains_and_natural_partition(de_en, tmp_path):
    task = _task(de_en, tmp_path)
    d = task.describe()
    assert d["domains"] == ["news", "subs"] and d["clients"] == 2 and d["client_names"] == ["news", "subs"]
    assert (d["train_pairs"], d["valid_pairs"], d["test_pairs"]) == (96 + 72, 12 + 9, 12 + 9)
    # splits are disjoint (as pair positions) and fixed whatever the run seed
    other = _task(de_en, tmp_path, seed=5)
    assert [(p.src, p.domain) for p in task.corpus.splits["test"]] == [
        (p.src, p.domain) for p in other.corpus.splits["test"]
    ]
    assert {p.domain for i in task.shards[0] for p in [task.corpus.splits["train"][i]]} == {"news"}
    iid = _task(de_en, tmp_path, partition="iid", clients=4)
    assert iid.num_clients == 4 and sorted(i for s in iid.shards for i in s.tolist()) == list(range(168))
    dirich = _task(de_en, tmp_path, partition="dirichlet:0.5", clients=3)
    assert sorted(i for s in dirich.shards for i in s.tolist()) == list(range(168))


def test_natural_partition_by_docid_in_one_domain(de_en, tmp_path):
    task = _task(de_en / "subs", tmp_path)
    assert task.shard_names == ["movie0", "movie1", "movie2"]
    for k, shard in enumerate(task.shards):
        assert {task.corpus.splits["train"][i].docid for i in shard} == {f"movie{k}"}
    with pytest.raises(TaskError, match="drop clients"):
        _task(de_en / "subs", tmp_path, clients=5)


def test_shared_subword_vocab_is_cached(de_en, tmp_path):
    task = _task(de_en, tmp_path)
    cached = list((tmp_path / "cache" / "spm").glob("*.model"))
    assert len(cached) == 1
    again = _task(de_en, tmp_path)  # loads the cached model
    assert again.vocab.sp.serialized_model_proto() == task.vocab.sp.serialized_model_proto()
    ids = task.vocab.encode(["der hund", "The dog"], 64)
    assert task.vocab.decode(ids) == ["der hund", "The dog"]  # one vocabulary for both languages
    assert task.vocab.sp.pad_id() == PAD and task.vocab.sp.bos_id() == BOS and task.vocab.sp.eos_id() == EOS


def test_transformer_configs_shapes_groups_and_no_persistent_buffers():
    base = transformer_config("base")
    assert (base.layers_enc, base.layers_dec, base.d_model, base.heads, base.ffn) == (6, 6, 512, 8, 2048)
    model = TransformerNMT(100, transformer_config("tiny"), seed=0).eval()
    state = model_state(model)
    assert set(model.state_dict()) == set(state)  # positional encodings are not part of the state
    assert {k.split(".")[0] for k in state} == {"encoder", "decoder"}
    assert state["decoder.embed.weight"].shape == (100, 64) and not any("out_proj" in k for k in state)
    src = torch.tensor([[5, 6, 7, EOS], [8, EOS, PAD, PAD]])
    tin = torch.tensor([[BOS, 9, 10], [BOS, 11, PAD]])
    logits = model(src, tin)
    assert logits.shape == (2, 3, 100)
    # padding in the source does not change the other positions' outputs
    logits2 = model(torch.tensor([[8, EOS]]), torch.tensor([[BOS, 11]]))
    torch.testing.assert_close(logits[1, :2], logits2[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(TaskError, match="unknown NMT model"):
        transformer_config("huge")


def test_groups_follow_encoder_decoder(de_en, tmp_path):
    task = _task(de_en, tmp_path)
    model = task.build_model(0)
    groups = task.groups()
    manifest = task.manifest(model)
    assert set(groups.values()) == {"encoder", "decoder"}
    assert manifest.names == list(model_state(model))
    assert all(spec.group == name.split(".")[0] for name, spec in zip(manifest.names, manifest.tensors))


@torch.no_grad()
def _seq_logprob(model, src, hyp):
    """Log-probability of ``hyp`` + eos under the decoder's distribution with PAD/BOS excluded
    (as decoding does)."""
    tin = torch.tensor([[BOS] + hyp])
    tout = hyp + [EOS]
    mem, mask = model.encode(src)
    logits = model.decode(tin, mem, mask)[0]
    logits[:, [PAD, BOS]] = float("-inf")
    logp = logits.log_softmax(-1)
    return float(sum(logp[i, t] for i, t in enumerate(tout)))


def test_greedy_and_beam_decoding():
    model = TransformerNMT(30, transformer_config("tiny", dropout=0.0, max_len=12), seed=4).eval()
    src = pad([[5, 6, 7, EOS], [8, 9, EOS]])
    g = greedy(model, src)
    assert beam_search(model, src, beam=1) == g
    b = beam_search(model, src, beam=4, length_penalty=0.0)
    for i in range(2):
        assert all(t not in (PAD, BOS, EOS) for t in b[i])
        # with no length normalisation, beam search finds a sequence at least as likely as greedy's
        assert _seq_logprob(model, src[i : i + 1], b[i]) >= _seq_logprob(model, src[i : i + 1], g[i]) - 1e-4


def test_training_deterministic_and_bleu_rises(de_en, tmp_path):
    task = _task(de_en, tmp_path, model="tiny", clients=1, partition="iid", dropout=0.1)
    cfg = TrainConfig(epochs=25, batch_size=16, lr=3e-3, optimizer="adam", clip=1.0, seed=1)
    a, b = task.build_model(0), task.build_model(0)
    bleu0 = task.evaluate(a, "valid")
    ra = task.train(a, 0, cfg)
    rb = task.train(b, 0, TrainConfig(**{**vars(cfg), "max_steps": 11}))
    assert ra.n_samples == 168 and rb.steps == 11
    c = task.build_model(0)
    rc = task.train(c, 0, TrainConfig(**{**vars(cfg), "max_steps": 11}))
    assert rb.loss == rc.loss and all(
        torch.equal(x, y) for x, y in zip(model_state(b).values(), model_state(c).values())
    )
    bleu = task.evaluate(a, "valid")
    assert bleu0 < 5 and bleu > 50, (bleu0, bleu)  # a toy language is learnt almost perfectly
    assert task.translate(a, ["der mann schläft ."]) == ["The man sleeps."]
    # cross-entropy under teacher forcing: near log(vocab) untrained, near 0 on a language the model has
    # learnt; batched with padding it equals the per-pair sums (padding counts no token)
    pairs = task.eval_pairs("valid")
    ce0, ce = task.cross_entropy(task.build_model(0), pairs), task.cross_entropy(a, pairs)
    assert ce < 0.5 < 2.0 < ce0 < 2 * math.log(len(task.vocab)), (ce0, ce)
    single = [
        (task.cross_entropy(a, [p]), len(task.vocab.encode([p.tgt], task.max_len)[0]) + 1) for p in pairs
    ]
    assert ce == pytest.approx(sum(v * n for v, n in single) / sum(n for _, n in single), rel=1e-5)


def test_bad_options(de_en, tmp_path):
    with pytest.raises(TaskError, match="needs --data"):
        make_task("nmt")
    with pytest.raises(TaskError, match="no such folder"):
        make_task("nmt", data=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no parallel files"):
        make_task("nmt", data=str(tmp_path / "empty"))
    with pytest.raises(TaskError, match="unknown domain"):
        make_task("nmt", data=str(de_en), domains="news,law", cache_dir=str(tmp_path / "c"))
    with pytest.raises(TaskError, match="unknown NMT model"):
        make_task("nmt", data=str(de_en), model="gru-small", cache_dir=str(tmp_path / "c"))
    (de_en / "subs" / "corpus.en").write_text("only one line\n")
    with pytest.raises(TaskError, match="line-aligned") as info:
        make_task("nmt", data=str(de_en), cache_dir=str(tmp_path / "c"))
    assert "\n" not in str(info.value)
