"""Language-modelling corpora: reading, vocabulary, and the token-stream batching used for training and
evaluation.

Layouts (detected from the folder's files):
- WikiText-2: ``wiki.{train,valid,test}.tokens``; articles start with a `` = Title = `` line (their category).
- PTB (Mikolov): ``ptb.{train,valid,test}.txt``; no documents (category = block of 100 consecutive lines).
- generic: ``train.txt``, ``valid.txt``, ``test.txt``, one sentence per line (Yelp, Reddit, ...); an optional
  ``train.docid`` (one id per training line) names each line's document for natural/Dirichlet partitions.
- ``builtin``: the text of Python's own documentation topics (``pydoc_data.topics``, shipped with CPython),
  lower-cased and split into word/punctuation tokens; a deterministic 90/5/5 split of its lines.

Every line gets a trailing ``<eos>`` (pytorch/examples word_language_model); empty lines are kept as a lone
``<eos>``. The vocabulary is built from the (possibly capped) training split only: words seen fewer than
``min_count`` times there are ``<unk>``, and ``vocab_size`` keeps the commonest of the rest.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedmq.tasks.corpora import resolve
from fedmq.tasks.errors import TaskError

EOS = "<eos>"
UNK = "<unk>"
SPLITS = ("train", "valid", "test")
_LAYOUTS = {
    "wikitext": "wiki.{split}.tokens",
    "ptb": "ptb.{split}.txt",
    "generic": "{split}.txt",
}
_WORD = re.compile(r"[a-z0-9_]+|[^\sa-z0-9_]")
_PTB_BLOCK = 100


@dataclass
class LMCorpus:
    """Tokenised lines of each split (without ``<eos>``) plus the category of every training line."""

    name: str
    lines: dict[str, list[list[str]]]
    categories: list[str]  # one per training line (document / article / topic / block)
    natural_categories: bool  # False when categories are only blocks of lines (no documents in the corpus)
    source: str = ""
    extra: dict[str, object] = field(default_factory=dict)


class Vocabulary:
    """Word <-> id. ``<eos>`` = 0, ``<unk>`` = 1, then words by decreasing training frequency (ties:
    first seen). ``min_count``: a word seen fewer times in the training split is ``<unk>`` (so ``<unk>`` is
    a training target, and a test word never seen in training scores what rare words taught it);
    ``max_size`` then keeps the commonest of the rest: both limits apply."""

    def __init__(self, words: list[str]) -> None:
        self.itos = words
        self.stoi = {w: i for i, w in enumerate(words)}
        self.unk = self.stoi[UNK]
        self.eos = self.stoi[EOS]

    @classmethod
    def build(cls, lines: list[list[str]], max_size: int | None = None, min_count: int = 1) -> Vocabulary:
        if isinstance(min_count, bool) or not isinstance(min_count, int):
            raise TaskError(f"min_count (--min-count) must be a whole number, got {min_count!r}")
        if min_count < 1:
            raise TaskError(f"min_count (--min-count) must be at least 1, got {min_count}")
        if max_size is not None and max_size < 3:
            raise TaskError(
                f"vocab_size (--vocab-size) must be at least 3 (<eos>, <unk> and one word), got {max_size}"
            )
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(line)
        counts.pop(EOS, None)
        counts.pop(UNK, None)
        # stable: ties keep first-seen order
        order = sorted((w for w in counts if counts[w] >= min_count), key=lambda w: -counts[w])
        if counts and not order:
            raise TaskError(
                f"min_count (--min-count) is {min_count} but no training word occurs that often "
                f"(the commonest: {max(counts.values())} times): lower it"
            )
        words = [EOS, UNK] + order
        if max_size is not None:
            words = words[:max_size]
        return cls(words)

    def __len__(self) -> int:
        return len(self.itos)

    def encode_lines(self, lines: list[list[str]]) -> torch.Tensor:
        """One flat id stream: every line's words then ``<eos>``."""
        ids: list[int] = []
        get, unk, eos = self.stoi.get, self.unk, self.eos
        for line in lines:
            ids.extend(get(w, unk) for w in line)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)


def load_corpus(
    data: str | Path, max_lines: int | None = None, max_eval_lines: int | None = None
) -> LMCorpus:
    """Read a corpus folder (or ``"builtin"``); ``max_lines`` caps the training split,
    ``max_eval_lines`` valid/test."""
    if str(data) == "builtin":
        corpus = builtin_corpus()
    else:
        folder = Path(resolve(data))
        layout = detect_layout(folder)
        lines = {s: _read_lines(folder / _LAYOUTS[layout].format(split=s)) for s in SPLITS}
        cats, natural = _categories(folder, layout, lines["train"])
        corpus = LMCorpus(layout, lines, cats, natural, source=str(folder))
    return _capped(corpus, max_lines, max_eval_lines)


def detect_layout(folder: Path) -> str:
    for layout, pattern in _LAYOUTS.items():
        if all((folder / pattern.format(split=s)).is_file() for s in SPLITS):
            return layout
    raise TaskError(
        f"{str(folder)!r} has no LM corpus: expected wiki.{{train,valid,test}}.tokens (WikiText-2), "
        "ptb.{train,valid,test}.txt (PTB) or train.txt/valid.txt/test.txt"
    )


def builtin_corpus() -> LMCorpus:
    """Python's documentation topics as a small English corpus; every 20 lines: 18 train, 1 valid, 1 test."""
    from pydoc_data.topics import topics

    lines: dict[str, list[list[str]]] = {s: [] for s in SPLITS}
    cats: list[str] = []
    i = 0
    for key in sorted(topics):
        for raw in topics[key].splitlines():
            words = _WORD.findall(raw.lower())
            if not words:
                continue
            split = "valid" if i % 20 == 18 else "test" if i % 20 == 19 else "train"
            lines[split].append(words)
            if split == "train":
                cats.append(key)
            i += 1
    return LMCorpus("builtin", lines, cats, True, source="pydoc_data.topics")


def _read_lines(path: Path) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.split() for line in f]
    except UnicodeDecodeError as e:
        raise TaskError(f"{str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TaskError(f"cannot read {str(path)!r}: {e.strerror}") from None


def _categories(folder: Path, layout: str, train: list[list[str]]) -> tuple[list[str], bool]:
    docid = folder / "train.docid"
    if docid.is_file():
        with open(docid, encoding="utf-8") as f:
            ids = [line.strip() for line in f]
        if len(ids) != len(train):
            raise TaskError(
                f"{str(docid)!r} has {len(ids)} lines but the training split has {len(train)}: "
                "one id per line"
            )
        return ids, True
    if layout == "wikitext":
        cats, article = [], 0
        for line in train:
            # top-level headings are "= Title =" (subsections use "= = ... = =")
            if len(line) >= 3 and line[0] == "=" and line[-1] == "=" and line[1] != "=":
                article += 1
            cats.append(f"article-{article:05d}")
        return cats, True
    return [f"block-{i // _PTB_BLOCK:06d}" for i in range(len(train))], False


def _capped(corpus: LMCorpus, max_lines: int | None, max_eval_lines: int | None) -> LMCorpus:
    for opt, value in (("--max-lines", max_lines), ("max_eval_lines", max_eval_lines)):
        if value is not None and value < 1:
            raise TaskError(f"{opt} must be a positive number of lines, got {value}")
    if max_lines is not None:
        corpus.lines["train"] = corpus.lines["train"][:max_lines]
        corpus.categories = corpus.categories[:max_lines]
    if max_eval_lines is not None:
        for s in ("valid", "test"):
            corpus.lines[s] = corpus.lines[s][:max_eval_lines]
    for s in SPLITS:
        if not corpus.lines[s]:
            raise TaskError(f"the {s} split of {corpus.source or corpus.name!r} is empty")
    return corpus


@dataclass
class StreamBatches:
    """A token stream laid out in ``cols`` columns with a padding mask,
    so every token is a target exactly once.

    The stream is preceded by one ``<eos>`` (context for the first token); column j predicts the tokens
    [j*L, (j+1)*L) of the stream; the last column(s) are padded and masked. Nothing is dropped.
    """

    inputs: torch.Tensor  # [L, cols] long
    targets: torch.Tensor  # [L, cols] long
    mask: torch.Tensor  # [L, cols] bool
    n_targets: int

    @classmethod
    def build(cls, ids: torch.Tensor, cols: int, eos: int) -> StreamBatches:
        n = int(ids.numel())
        cols = max(1, min(cols, n))
        length = -(-n // cols)
        stream = torch.cat([torch.tensor([eos], dtype=torch.long), ids])
        pad = length * cols - n
        targets = torch.cat([stream[1:], torch.full((pad,), eos, dtype=torch.long)])
        inputs = torch.cat([stream[:-1], torch.full((pad,), eos, dtype=torch.long)])
        mask = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
        shape = (cols, length)
        return cls(
            inputs.view(shape).t().contiguous(),
            targets.view(shape).t().contiguous(),
            mask.view(shape).t().contiguous(),
            n,
        )

    def to(self, device: torch.device) -> StreamBatches:
        """The same batches on ``device``: moved once, so a training or evaluation pass copies nothing per
        step (a GPU step that waits for its own input copy cannot overlap the next one)."""
        return StreamBatches(
            self.inputs.to(device), self.targets.to(device), self.mask.to(device), self.n_targets
        )

    def window_targets(self, bptt: int) -> list[int]:
        """The number of real (unmasked) targets in each window, counted once on the CPU."""
        return [int(m.sum()) for _, _, m in self.windows(bptt)]

    def windows(self, bptt: int):
        """(inputs, targets, mask) slices of at most ``bptt`` time steps, in order."""
        for i in range(self.num_windows(bptt)):
            yield self.window(i, bptt)

    def window(self, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window ``i`` of ``windows(bptt)``."""
        start, end = i * bptt, (i + 1) * bptt
        return self.inputs[start:end], self.targets[start:end], self.mask[start:end]

    def num_windows(self, bptt: int) -> int:
        return -(-self.inputs.size(0) // bptt)
