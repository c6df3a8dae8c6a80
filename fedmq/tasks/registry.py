"""``make_task(name, **options)``: the CLI's entry point to the tasks
(``--task lm|nmt|package.module:Class``)."""

from __future__ import annotations

import inspect
from typing import Any

from fedmq.plugins import is_import_path, load_class
from fedmq.tasks.base import Task
from fedmq.tasks.catalog import LM_ONLY, NMT_ONLY
from fedmq.tasks.corpora import ENV, corpus_dir
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm import LanguageModelTask
from fedmq.tasks.nmt import TranslationTask

TASKS: dict[str, type[Task]] = {"lm": LanguageModelTask, "nmt": TranslationTask}
# "0 = no cap" on the CLI
_ZERO_IS_NONE = ("vocab_size", "max_lines", "max_eval_lines")


def make_task(name: str, **options: Any) -> Task:
    """Build a task; options are the task class's keyword arguments (None values mean "the default").

    Options that only apply to the other task (e.g. ``tied``/``bptt`` for nmt) are ignored, and 0 means "no
    cap" for vocab_size, max_lines and max_eval_lines, so the CLI can pass all its flags to either task.

    lm: data ("builtin" or a folder), model (gru-tiny|gru-small|gru-medium|gru-large|lstm), tied, dropout,
    clients, partition (iid|dirichlet:ALPHA|natural), vocab_size, max_lines, max_eval_lines, bptt, seed, emb,
    hidden, layers. nmt: data, model (tiny|small|base), clients, partition, domains, vocab_size, max_lines,
    dropout, label_smoothing, max_len, eval_max_sentences, beam, eval_batch, seed, cache_dir, eval_fraction.
    """
    if is_import_path(name):
        return _make_own_task(name, options)
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}: use one of {', '.join(TASKS)} or package.module:Class")
    cls = TASKS[name]
    ignored = LM_ONLY if name == "nmt" else NMT_ONLY
    options = {k: v for k, v in options.items() if k not in ignored and not (k in _ZERO_IS_NONE and v == 0)}
    params = inspect.signature(cls.__init__).parameters
    allowed = {p for p in params if p not in ("self", "corpus")}
    unknown = sorted(k for k in options if k not in allowed)
    if unknown:
        raise TaskError(f"task {name!r} has no option {', '.join(unknown)}: use {', '.join(sorted(allowed))}")
    if name == "nmt" and options.get("data") in (None, "builtin"):
        raise TaskError(
            "the nmt task needs --data: a folder of X.de/X.en files or of domain folders, or a name in the "
            f"data folder ${ENV} (--data de-en: {corpus_dir('de-en')})"
        )
    for key in ("clients", "vocab_size", "max_lines", "max_eval_lines", "bptt", "seed"):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TaskError(f"option {key} must be a whole number, got {value!r}")
    if name == "nmt" and isinstance(options.get("domains"), str):
        options["domains"] = [d for d in options["domains"].split(",") if d]
    return cls(**{k: v for k, v in options.items() if v is not None})


def _make_own_task(path: str, options: dict[str, Any]) -> Task:
    """A user's Task class, given the options its constructor names (the CLI passes all its flags; the rest
    are for the built-in tasks and are dropped). Anything it raises is one TaskError line."""
    cls = load_class(path, Task, "task", TaskError)
    params = inspect.signature(cls.__init__).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in options.items() if v is not None and (takes_all or k in params)}
    try:
        task = cls(**given)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {path!r} could not be built: {type(exc).__name__}: {exc}") from None
    for attr in ("name", "metric", "higher_is_better"):
        if not hasattr(task, attr):
            raise TaskError(f"task {path!r} must set the class attribute {attr!r}")
    return task
