"""`fedmq simulate`'s options, resolved and checked before anything imports torch.

Resolution, lowest to highest: the flags' defaults < the ``--config`` TOML file < the flags a user typed
(click's parameter source tells them apart from defaults). The file is the one the services read
(`aggregator run --config`): JobConfig keys at the top level, task options in a ``[task]`` table; ``job`` and
``identity`` in it are ignored (simulate names its own job and checks identity by broker URL). Availability,
faults, device and broker are flags only.

``--resume`` rebuilds the run from the options it recorded in its ``config.json`` (``extra.cli``): an option
given again (as a flag or in ``--config``) must have its saved value, except those that only say where or how
long it runs (``RESUMABLE``: ``--rounds`` extends a run, ``--device``, ``--cohort``, ``--trainers``,
``--broker``); any other difference is refused in one line. A run folder written before options were
recorded is resumed from its JobConfig keys and the task facts it kept (task, model, partition, bptt, tied,
dropout); the checkpoint check in cli/run_folder.py catches the rest.

Everything here is torch-free (aggregator.config, client_agent.availability, fedmq.tasks.catalog and
.partition, broker.transport.connect's URL check), so a bad flag is rejected in well under a second.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmq.aggregator.config import FLAGS, JobConfig, read_job_file
from fedmq.aggregator.job_keys import FORMER_KEYS, JobConfigError, former_key_args, with_strategy_args
from fedmq.cli.errors import UsageError
from fedmq.params import parse_assignments
from fedmq.plugins import is_import_path
from fedmq.tasks.catalog import LM_ONLY, MODELS, NMT_ONLY, TASKS

# flag -> JobConfig field (aggregator.config.FLAGS, the one list of them)
JOB_FLAGS = {flag.removeprefix("--").replace("-", "_"): field for field, flag in FLAGS.items()}
# the former JobConfig keys that are a built-in strategy's parameters now (aggregator.job_keys.FORMER_KEYS)
# under their option names: the flag kept for one (--eps sets FedAtt's epsilon), else the key a file may set
FORMER_OPTIONS = {key: former.flag.removeprefix("--") or key for key, former in FORMER_KEYS.items()}
# flags handed to the task (clients and seed go to both)
TASK_FLAGS = (
    "task",
    "data",
    "model",
    "tied",
    "clients",
    "partition",
    "vocab_size",
    "min_count",
    "max_lines",
    "max_eval_lines",
    "domains",
    "eval_max_sentences",
    "beam",
    "bptt",
    "dropout",
    "seed",
)
# (availability, faults, device and broker are flags only; the command reads them from the options)
# flags about this invocation, not the run: never recorded, never compared on --resume
NOT_RECORDED = ("config", "out", "resume", "keep_queues", "as_json", "log_level", "metrics_port")
# --strategy-arg KEY=VALUE, over the file's [strategy] table (JobConfig.strategy_args)
STRATEGY_ARG = "strategy_arg"
RESUMABLE = ("rounds", "device", "cohort", "trainers", "broker")
# JobConfig keys without a flag (the file may set them) and the task options without one
FILE_JOB_KEYS = tuple(
    f.name
    for f in dataclasses.fields(JobConfig)
    if f.name not in JOB_FLAGS.values() and f.name not in ("job", "identity", "extra")
)
FILE_TASK_KEYS = (
    "emb",
    "hidden",
    "layers",
    "label_smoothing",
    "max_len",
    "eval_batch",
    "cache_dir",
    "eval_fraction",
)
FILE_IGNORED = ("job", "identity")
DEFAULT_MODEL = {"lm": "gru-tiny", "nmt": "small"}  # CPU scale; the tasks' own defaults are the papers' sizes
DEFAULT_CLIENTS = 8
SIM_JOB_DEFAULTS = {"heartbeat_s": 1.0, "join_timeout_s": 60.0}  # one process: agents are up within a second
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class Plan:
    """What `simulate` runs: the resolved options (recorded in config.json) and what they become."""

    options: dict[str, Any]
    job: JobConfig
    task: dict[str, Any]


def option_name(name: str) -> str:
    return "--json" if name == "as_json" else "--" + name.replace("_", "-")


def from_context(ctx: Any, command: Any, saved: dict[str, Any] | None = None) -> Plan:
    """``resolve`` for a parsed click/typer context: the typed flags are those not from their defaults."""
    given = {
        name for name in ctx.params if ctx.get_parameter_source(name).name not in ("DEFAULT", "DEFAULT_MAP")
    }
    return resolve(dict(ctx.params), given, param_types(command), ctx.params.get("config"), saved)


def param_types(fn: Any) -> dict[str, str]:
    """Each parameter's type name (int, float, str, bool), Optional unwrapped:
    how --config values are checked."""
    import typing

    out = {}
    for name, hint in typing.get_type_hints(fn).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = getattr(args[0] if args else hint, "__name__", str(hint))
    return out


def resolve(
    params: dict[str, Any],
    given: set[str],
    types: dict[str, str],
    config: Path | None = None,
    saved: dict[str, Any] | None = None,
) -> Plan:
    """The run's options from the command line (``params``: every flag's value; ``given``: the ones typed;
    ``types``: each flag's type name, see ``param_types``), the ``--config`` file and, on --resume, the saved
    options."""
    defaults = {k: v for k, v in params.items() if k not in NOT_RECORDED}
    typed = {k: params[k] for k in given if k not in NOT_RECORDED}
    from_file = read_config_file(config, types) if config is not None else {}
    explicit = {**from_file, **typed}
    if saved is not None:
        base = {**defaults, **saved}
        changed = [k for k, v in explicit.items() if k not in RESUMABLE and _norm(v) != _norm(base.get(k))]
        if changed:
            diffs = ", ".join(
                f"{option_name(k) if k in params else k} {_show(explicit[k])} (saved: {_show(base.get(k))})"
                for k in sorted(changed)
            )
            raise UsageError(
                f"--resume continues the run with its saved options; these differ: {diffs}. "
                "Drop them, or start a new run with another --out"
            )
        values = {**base, **{k: v for k, v in explicit.items() if k in RESUMABLE}}
    else:
        values = {**defaults, **explicit}
    values["domains"] = _norm(values.get("domains"))
    task = values["task"]
    own = is_import_path(task)  # a Task the user brings: it takes the options its constructor names
    if task not in TASKS and not own:
        raise UsageError(f"unknown task {task!r}: use one of {', '.join(TASKS)} or package.module:Class")
    values["model"] = values.get("model") or (None if own else DEFAULT_MODEL[task])
    if values.get("clients") is None and values["partition"] != "natural":  # natural: one per category
        values["clients"] = DEFAULT_CLIENTS
    other = () if own else NMT_ONLY if task == "lm" else LM_ONLY
    foreign = sorted(k for k in explicit if k in other)
    if foreign:
        names = ", ".join(option_name(k) if k in params else k for k in foreign)
        raise UsageError(f"{names}: {'nmt' if task == 'lm' else 'lm'} option(s), not used by --task {task}")
    check(values)
    from fedmq.cli.logs import LEVELS

    if params.get("log_level", "info") not in LEVELS:
        raise UsageError(f"unknown log level {params['log_level']!r}; use one of {', '.join(LEVELS)}")
    port = params.get("metrics_port") or 0
    if not 0 <= port <= 65535:
        raise UsageError(f"--metrics-port must be a TCP port, 1 to 65535 (0 = off), got {port}")
    return Plan(values, _job_config(values), _task_options(values))


def read_config_file(path: Path, types: dict[str, str]) -> dict[str, Any]:
    """The file's values under simulate's option names (read by aggregator.config.read_job_file, as every
    command reads it); one line for a task option simulate does not know, or two values that contradict."""
    try:
        jobfile = read_job_file(path)
    except JobConfigError as exc:
        raise UsageError(str(exc)) from None
    flag_of = {field: flag for flag, field in JOB_FLAGS.items()} | FORMER_OPTIONS
    out: dict[str, Any] = {}

    def put(name: str, value: Any, kind: str | None, where: str) -> None:
        value = _typed(value, kind, f"config file {path}: {where}")
        if name in out and _norm(out[name]) != _norm(value):
            raise UsageError(
                f"config file {path}: {where} = {_show(value)} contradicts {_show(out[name])} set above"
            )
        out[name] = value

    unknown = sorted(f"task.{k}" for k in jobfile.task if k not in TASK_FLAGS and k not in FILE_TASK_KEYS)
    if unknown:
        raise UsageError(
            f"config file {path}: unknown key(s) {', '.join(unknown)} (JobConfig keys at the top level, "
            "task options in [task])"
        )
    for key, value in jobfile.job.items():
        if key == "strategy_args":  # the [strategy] table's parameters, a table of their own
            out[key] = value
        elif key not in FILE_IGNORED:
            put(flag_of.get(key, key), value, None, key)
    for key, value in jobfile.task.items():
        if key == "domains" and isinstance(value, list):
            value = ",".join(map(str, value))
        put(key, value, types.get(key) if key in TASK_FLAGS else None, f"task.{key}")
    return out


def check(values: dict[str, Any]) -> None:
    """Every option that can be checked without torch; UsageError or another FedmqError, one line."""
    from fedmq.broker.transport.urls import check_url
    from fedmq.client_agent.availability import parse_availability, parse_faults
    from fedmq.population import check_population
    from fedmq.tasks.partition import PartitionSpec

    task, model = values["task"], values["model"]
    if task in MODELS:  # a task the user brings checks its own model and data
        if model not in MODELS[task]:
            raise UsageError(f"unknown {task} model {model!r}: use one of {', '.join(MODELS[task])}")
        check_data(task, values["data"])
    PartitionSpec.parse(values["partition"])
    for name in ("vocab_size", "max_lines", "max_eval_lines", "eval_max_sentences"):
        if (values.get(name) or 0) < 0:
            raise UsageError(f"{option_name(name)} must not be negative (0 means no cap)")
    for name in ("clients", "bptt", "beam", "min_count", "trainers"):
        if values.get(name) is not None and values[name] < 1:
            raise UsageError(f"{option_name(name)} must be at least 1, got {values[name]}")
    if not 0 <= values["dropout"] < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {values['dropout']}")
    if task == "nmt" and values.get("domains") is not None and not values["domains"].strip(", "):
        raise UsageError("--domains wants comma-separated domain folder names, e.g. news_wmt,ted_iwslt14")
    parse_availability(values["availability"], values["seed"])
    parse_faults(values["faults"], values["seed"])
    if not _DEVICE.match(str(values["device"])):
        raise UsageError(f"unknown --device {values['device']!r}: use auto, cpu, cuda or cuda:N")
    check_url(values["broker"])
    if values.get("clients"):  # memory alone (who trains at once is known with the job: Simulation checks it)
        check_population(values["clients"], 0)


def check_data(task: str, data: str) -> None:
    """``--data``: builtin (lm only), a folder, or a corpus name kept in the local cache (fedmq.tasks.corpora,
    torch-free); anything else gets its one line here, before torch loads."""
    if data == "builtin":
        if task == "nmt":
            raise UsageError(
                "the nmt task needs --data PATH to a folder of X.de/X.en files or of domain folders"
            )
        return
    from fedmq.tasks.corpora import resolve
    from fedmq.tasks.errors import TaskError

    try:
        resolve(data)
    except TaskError as exc:
        raise UsageError(str(exc)) from None


def saved_options(config: dict[str, Any]) -> dict[str, Any]:
    """The options a run folder's config.json recorded; for a folder from before they were recorded, what its
    JobConfig keys and task facts say."""
    record = (config.get("extra") or {}).get("cli")
    # a run from before --min-count built its vocabulary from every training word, and one from before
    # --lr-anneal never annealed
    before = {"min_count": 1, "lr_anneal": 1.0}
    if isinstance(record, dict):
        return {**before, **record}
    legacy = {flag: config[field] for flag, field in JOB_FLAGS.items() if field in config}
    legacy.update({option: config[key] for key, option in FORMER_OPTIONS.items() if key in config})
    legacy.update({k: config.get(k, v) for k, v in before.items()})
    legacy.update({k: config[k] for k in FILE_JOB_KEYS if k in config})
    legacy.update({k: config[k] for k in ("task", "model", "partition", "bptt") if k in config})
    model_config = config.get("model_config")
    if isinstance(model_config, dict):
        legacy.update({k: model_config[k] for k in ("tied", "dropout") if k in model_config})
    return legacy


def _job_config(values: dict[str, Any]) -> JobConfig:
    job = "sim" if values["broker"].startswith("memory://") else f"sim-{uuid.uuid4().hex[:8]}"
    fields = {field: values[flag] for flag, field in JOB_FLAGS.items()}
    fields["clients"] = values["clients"] or 1  # nmt natural: one per domain, set once the task is built
    fields.update({k: values.get(k, v) for k, v in SIM_JOB_DEFAULTS.items()})
    fields.update({k: values[k] for k in FILE_JOB_KEYS if k in values})
    flags = parse_assignments(values.get(STRATEGY_ARG) or [])
    fields["strategy_args"] = {**(values.get("strategy_args") or {}), **flags}
    former = {k: values[o] for k, o in FORMER_OPTIONS.items() if values.get(o) is not None}
    if former and isinstance(fields["strategy"], str):
        where = ", ".join(
            k if FORMER_OPTIONS[k] == k else option_name(FORMER_OPTIONS[k]) for k in sorted(former)
        )
        fields = with_strategy_args(fields, former_key_args(fields["strategy"], former), where)
    try:
        return JobConfig(job=job, extra={"cli": values}, **fields)
    except TypeError as exc:  # a value of the wrong type that slipped past the checks
        raise UsageError(f"bad option value: {exc}") from None


def _task_options(values: dict[str, Any]) -> dict[str, Any]:
    """Task options; None means "the task's default" (e.g. tied per model, one client per domain)."""
    opts = {k: values.get(k) for k in TASK_FLAGS}
    opts.update({k: values[k] for k in FILE_TASK_KEYS if k in values})
    return {k: v for k, v in opts.items() if v is not None}


def _typed(value: Any, kind: str | None, where: str) -> Any:
    """A TOML value as the flag's type would have it (ints for floats are fine; nothing else is converted)."""
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError(f"{where} must be a whole number, got {_show(value)}")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{where} must be a number, got {_show(value)}")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise UsageError(f"{where} must be true or false, got {_show(value)}")
    if kind == "str" and not isinstance(value, str):
        raise UsageError(f"{where} must be a string, got {_show(value)}")
    if kind is None and isinstance(value, (dict, list)):
        raise UsageError(f"{where} must be a single value, got {_show(value)}")
    return value


def _norm(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, Path):
        return str(value)
    return value


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    return (
        repr(value)
        if isinstance(value, str)
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )
