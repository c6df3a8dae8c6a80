"""Parallel German->English data: domains of ``X.de``/``X.en`` files, held-out splits,
the shared subword model.

``data`` is either one domain folder (files ``X.de`` + ``X.en``, line i of one translating line i of the
other, optionally ``X.docid`` naming each pair's document) or a folder of such domain folders
(``--data de-en``: ``$FEDMQ_DATA_DIR/de-en``, fedmq.tasks.corpora). All pairs of a domain are pooled (files
in sorted order) and split with a fixed seed (independent of the run seed, so every run evaluates on the same
pairs): ``eval_fraction`` of the pairs (at least 1, at most ``eval_max_pairs``) go to valid, as many to test,
the rest to train.

The subword vocabulary is a sentencepiece BPE model shared by source and target, trained locally on the
training split of both languages and cached under ``cache_dir`` keyed by a digest of its input;
nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import torch

from fedmq.files import write_atomic
from fedmq.tasks.corpora import resolve
from fedmq.tasks.errors import TaskError

log = structlog.get_logger(__name__)

SPLIT_SEED = 20240501
PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass
class Pair:
    src: str
    tgt: str
    domain: str
    docid: str


@dataclass
class ParallelCorpus:
    splits: dict[str, list[Pair]]
    domains: list[str]
    source: str
    extra: dict[str, object] = field(default_factory=dict)


def load_parallel(
    data: str | Path,
    domains: list[str] | None = None,
    max_lines: int | None = None,
    eval_fraction: float = 0.05,
    eval_max_pairs: int = 500,
    src_lang: str = "de",
    tgt_lang: str = "en",
) -> ParallelCorpus:
    if str(data) == "builtin":
        raise TaskError(
            f"translation needs --data: a folder of X.{src_lang}/X.{tgt_lang} files or of domain folders"
        )
    folder = Path(resolve(data))
    if max_lines is not None and max_lines < 3:
        raise TaskError(
            "max_lines (--max-lines) must be at least 3 for translation (train, valid and test pairs), "
            f"got {max_lines}"
        )
    if not 0 < eval_fraction < 0.5:
        raise TaskError(f"eval_fraction must be in (0, 0.5), got {eval_fraction}")
    if _stems(folder, src_lang, tgt_lang):
        found = {folder.name: folder}
    else:
        found = {d.name: d for d in sorted(folder.iterdir()) if d.is_dir() and _stems(d, src_lang, tgt_lang)}
    if not found:
        raise TaskError(
            f"{str(folder)!r} has no parallel files: "
            f"expected X.{src_lang} + X.{tgt_lang} pairs in it or in its subfolders"
        )
    if domains:
        missing = [d for d in domains if d not in found]
        if missing:
            raise TaskError(
                f"unknown domain(s) {', '.join(missing)} in {str(folder)!r}: available {', '.join(found)}"
            )
        found = {d: found[d] for d in domains}
    splits: dict[str, list[Pair]] = {"train": [], "valid": [], "test": []}
    for name, path in found.items():
        pairs = _read_domain(name, path, src_lang, tgt_lang)[: max_lines or None]
        if len(pairs) < 3:
            raise TaskError(f"domain {name!r} has {len(pairs)} usable pairs; it needs at least 3")
        order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
        n_eval = int(min(eval_max_pairs, max(1, round(eval_fraction * len(pairs)))))
        splits["valid"].extend(pairs[i] for i in order[:n_eval])
        splits["test"].extend(pairs[i] for i in order[n_eval : 2 * n_eval])
        splits["train"].extend(pairs[i] for i in sorted(order[2 * n_eval :]))
    return ParallelCorpus(splits, list(found), str(folder))


def _stems(folder: Path, src: str, tgt: str) -> list[str]:
    return sorted(p.stem for p in folder.glob(f"*.{src}") if (folder / f"{p.stem}.{tgt}").is_file())


def _read(path: Path) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        raise TaskError(f"{str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TaskError(f"cannot read {str(path)!r}: {e.strerror}") from None


def _read_domain(name: str, folder: Path, src: str, tgt: str) -> list[Pair]:
    pairs: list[Pair] = []
    for stem in _stems(folder, src, tgt):
        s, t = _read(folder / f"{stem}.{src}"), _read(folder / f"{stem}.{tgt}")
        if len(s) != len(t):
            raise TaskError(
                f"{str(folder / stem)}.{src} has {len(s)} lines but .{tgt} has {len(t)}: "
                "the files must be line-aligned"
            )
        docfile = folder / f"{stem}.docid"
        # no docid: the domain is the document
        docs = _read(docfile) if docfile.is_file() else [name] * len(s)
        if len(docs) != len(s):
            raise TaskError(
                f"{str(docfile)!r} has {len(docs)} lines but the pairs have {len(s)}: one id per pair"
            )
        pairs.extend(
            Pair(a.strip(), b.strip(), name, d.strip())
            for a, b, d in zip(s, t, docs)
            if a.strip() and b.strip()
        )
    return pairs


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDMQ_CACHE", Path.home() / ".cache" / "fedmq"))


class SubwordVocab:
    """Shared source/target sentencepiece BPE model; ids: pad 0, unk 1, bos 2, eos 3."""

    def __init__(self, model_bytes: bytes) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)

    @classmethod
    def train_or_load(
        cls, texts: list[str], vocab_size: int, cache_dir: str | Path | None = None
    ) -> SubwordVocab:
        import sentencepiece as spm

        if vocab_size < 16:
            raise TaskError(
                f"vocab_size (--vocab-size) must be at least 16 for a subword vocabulary, got {vocab_size}"
            )
        digest = hashlib.sha256()
        digest.update(f"bpe-v1|{vocab_size}|".encode())
        for t in texts:
            digest.update(t.encode("utf-8") + b"\n")
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        path = cache / "spm" / f"{digest.hexdigest()[:24]}.model"
        if path.is_file():
            return cls(path.read_bytes())
        out = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=out,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            hard_vocab_limit=False,
            input_sentence_size=400_000,
            shuffle_input_sentence=True,
            num_threads=1,
            minloglevel=2,
        )
        model = out.getvalue()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, model)
        except OSError as e:  # a read-only home is not fatal: the model is in memory
            log.warning("cannot cache the subword model", path=str(path), error=str(e))
        log.info("trained subword vocabulary", vocab_size=vocab_size, sentences=len(texts), path=str(path))
        return cls(model)

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str], max_len: int) -> list[list[int]]:
        """Subword ids without specials, truncated to ``max_len - 1`` (room for bos/eos)."""
        return [ids[: max_len - 1] for ids in self.sp.encode(texts)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.sp.decode(ids)


@dataclass
class EncodedPairs:
    src: list[list[int]]
    tgt: list[list[int]]

    def __len__(self) -> int:
        return len(self.src)


def batches_by_length(data: EncodedPairs, batch_size: int, gen: torch.Generator, pool: int = 50):
    """Shuffle, sort pools of ``pool * batch_size`` pairs by length, cut batches, shuffle the batch order."""
    n = len(data)
    perm = torch.randperm(n, generator=gen).tolist()
    batches: list[list[int]] = []
    step = pool * batch_size
    for start in range(0, n, step):
        chunk = sorted(perm[start : start + step], key=lambda i: (len(data.src[i]), len(data.tgt[i])))
        batches.extend(chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size))
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order]


def collate(data: EncodedPairs, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> src [B, S] (ids + eos), tgt_in [B, T] (bos + ids), tgt_out [B, T] (ids + eos); padded with PAD."""
    src = [data.src[i] + [EOS] for i in idx]
    tin = [[BOS] + data.tgt[i] for i in idx]
    tout = [data.tgt[i] + [EOS] for i in idx]
    return pad(src), pad(tin), pad(tout)


def pad(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
