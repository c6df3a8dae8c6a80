"""The results file an experiment keeps: one small JSON file per experiment and scale.

Format (``"format": "fedmq-results/1"``). ``fedmq experiment NAME --scale S`` (and scripts/reproduce.py)
writes ``OUT/NAME/NAME.S.json`` when it ends; the files kept in git are these, under ``benchmarks/results/``,
named ``NAME.S.json``, or ``NAME.S.VARIANT.json`` for the same grid with other settings or code (an
``--only``/``--set`` variant, an earlier client regime). The run folders themselves (metrics, checkpoints,
weights) are not kept: rerunning the file's command at its commit makes them again. One JSON object:

* ``format``, ``experiment`` (NAME), ``scale`` (smoke | cpu | paper), ``seeds`` (every seed of a row, sorted);
* ``command``: the command that makes the rows (``fedmq experiment ...``, or ``python scripts/reproduce.py
  ...`` where it takes ``--only``/``--set``); never ``--out``;
* ``overrides``: the job settings ``--set`` changed (``{}`` for none);
* ``commit``: the git commit the code was at (null outside a git checkout); ``dirty``: true when tracked files
  differed from it. A file converted from the earlier archive of run folders records, row by row, the commit
  that archived the run;
* ``runs``: one object per run and seed (written one a line):

  - ``run`` (the run's name in the grid, e.g. ``ptb-fedatt-c0.1``), ``seed``, the run's table labels
    (``corpus``, ``strategy``, ``C``, ``model``, ``beta``, ``noise``, ``E``, ``encoding``, ``availability``,
    ``pull`` ...: those its experiment names) and ``fraction`` (the client fraction C of its job);
  - ``test``: the score of the best-on-validation global model (perplexity for the LM experiments, lower is
    better; nmt-domains: BLEU of the engine's test pairs, higher is better); ``best_valid`` and ``best_round``
    (its validation score and round); ``rounds_completed``, ``rounds_skipped``;
  - ``bytes_up``, ``bytes_down`` (on the wire, summed over the run), ``bytes_up_raw``, ``bytes_down_raw`` (the
    same tensors as fp32), ``updates_received`` (updates folded over the run);
  - ``valid_curve``: the validation score after each round (6 significant digits; null for a round not
    evaluated), ``max_jump``: its largest round-to-round ratio after round 3;
  - ``wall_s`` (the run's wall time), ``round_s_median`` (a round's median wall time);
  - where they apply: ``finished: false`` (a run that stopped before its last round: no test score);
    ``strategy_rounds`` (FedMed's loss switch: the rounds aggregated by each rule, when more than one ran);
    ``bytes_up_raw_by_round`` / ``bytes_down_raw_by_round`` (when they vary between rounds);
    rounds-to-target's ``target``, ``rounds_to_target``, ``bytes_to_target``; nmt-domains'
    ``bleu_by_domain`` and ``ce_by_domain`` (test BLEU and cross-entropy, nats a reference token, of the
    server on each domain), their means over domains ``bleu_mean_domains`` and ``ce_mean_domains``, and
    ``ce_pick`` (the server read at its round of lowest validation cross-entropy: ``round``,
    ``bleu_by_domain``, ``ce_by_domain``, ``valid_ce_by_round``) with ``ce_pick_round``, ``bleu_ce_pick``,
    ``ce_ce_pick``;
  - ``command``, ``commit``, ``overrides``: present only where the row was made by another command, at another
    commit or with other settings than the file's (a grid run as several commands, one per cell and seed);
* nmt-domains only: ``models`` (the models that are not servers, seed-independent: the pre-trained engine and
  each client alone, with ``bleu_by_domain`` and ``ce_by_domain``) and ``pretrain`` (its pairs, tokens, loss,
  seconds).

Numbers are as the run recorded them (curves rounded as said); a number that is not finite (a diverged
run's perplexity) is the string ``"inf"`` or ``"nan"``. Means, standard deviations and paired orderings are
not kept: they follow from the rows (benchmarks/experiments/results.py ``mean_sd``, ``orderings``).

``python -m fedmq.benchmarks.results_file merge [--command TEXT] OUT IN [IN ...]`` merges files of one
experiment and scale into one (scripts/run_cells.sh runs a grid as one process a cell and seed, and merges
their files so).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fedmq.aggregator.runlog import read_rounds, read_summary
from fedmq.files import write_atomic

FORMAT = "fedmq-results/1"
KEPT = Path(__file__).resolve().parent / "results"  # the files kept in git
# the keys a row may carry to differ from its file's
ROW_OWN = ("command", "commit", "overrides")
# a table row's keys not taken from it: the curve is kept rounded, nmt-domains' scores are read from the run's
# summary.json (the same numbers, in one place in the row whichever code wrote it), a ratio is left out
_DROP = (
    "valid_curve",
    "bytes_up_per_round",
    "bleu_mean_domains",
    "ce_mean_domains",
    "ce_pick_round",
    "bleu_ce_pick",
    "ce_ce_pick",
)


def file_name(name: str, scale: str, variant: str | None = None) -> str:
    """``NAME.SCALE.json`` (``NAME.SCALE.VARIANT.json``)."""
    return f"{name}.{scale}{f'.{variant}' if variant else ''}.json"


def sig(value: float | None, digits: int = 6) -> float | None:
    """``value`` to ``digits`` significant digits (None stays None)."""
    if value is None or not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)  # as benchmarks/experiments/results.py averages them, to the last bit


def run_row(table_row: dict[str, Any], run_dir: Path, seed: int) -> dict[str, Any]:
    """The kept row of one run: ``table_row`` (its row of the experiment's table,
    benchmarks/experiments/results.py ``table_row``) without the per-round curve, plus what the run folder
    ``run_dir`` holds (module docstring)."""
    summary = read_summary(run_dir)
    rows = read_rounds(run_dir).records
    row: dict[str, Any] = {"run": table_row["run"], "seed": seed}
    row.update((k, v) for k, v in table_row.items() if k not in ("run", "seed", *_DROP))
    if summary is None:
        row["finished"] = False
        row["rounds_completed"] = len(rows)
        row["wall_s"] = None
    curve = [r.valid for r in rows]
    row["valid_curve"] = [sig(v) for v in curve]
    walls = [r.wall_s for r in rows if r.wall_s is not None]
    row["round_s_median"] = round(statistics.median(walls), 2) if walls else None
    used: dict[str, list[int]] = {}
    for r in rows:
        if r.strategy and not r.skipped:
            used.setdefault(r.strategy, []).append(r.round)
    if len(used) > 1:
        row["strategy_rounds"] = used
    for key in ("bytes_up_raw", "bytes_down_raw"):
        per_round = [getattr(r, key) or 0 for r in rows]
        if len(set(per_round)) > 1:
            row[f"{key}_by_round"] = per_round
    if summary is not None:
        row.update(_domain_scores(summary))
    return row


def _domain_scores(summary: dict[str, Any]) -> dict[str, Any]:
    """nmt-domains: the server's per-domain test BLEU and cross-entropy, their means, and its CE pick."""
    out: dict[str, Any] = {}
    bleu, ce = summary.get("test_bleu_by_domain"), summary.get("test_ce_by_domain")
    if isinstance(bleu, dict) and bleu:
        out["bleu_by_domain"] = bleu
        out["bleu_mean_domains"] = _mean(bleu.values())
    if isinstance(ce, dict) and ce:
        out["ce_by_domain"] = ce
        out["ce_mean_domains"] = _mean(ce.values())
    pick = summary.get("ce_pick")
    if isinstance(pick, dict):
        valid = pick.get("valid_ce_by_round", {})
        out["ce_pick"] = {
            "round": pick["round"],
            "bleu_by_domain": pick["test_bleu_by_domain"],
            "ce_by_domain": pick["test_ce_by_domain"],
            "valid_ce_by_round": [valid[k] for k in sorted(valid, key=int)],
        }
        out["ce_pick_round"] = pick["round"]
        out["bleu_ce_pick"] = _mean(pick["test_bleu_by_domain"].values())
        out["ce_ce_pick"] = _mean(pick["test_ce_by_domain"].values())
    return out


def document(
    experiment: str,
    scale: str,
    rows: Sequence[dict[str, Any]],
    command: str,
    overrides: dict[str, Any] | None = None,
    commit: str | None = None,
    dirty: bool = False,
    models: dict[str, dict[str, Any]] | None = None,
    pretrain: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A results file's content (module docstring); ``rows`` from :func:`run_row`."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "experiment": experiment,
        "scale": scale,
        "seeds": sorted({r["seed"] for r in rows}),
        "command": command,
        "overrides": dict(overrides or {}),
        "commit": commit,
    }
    if dirty:
        doc["dirty"] = True
    if models:
        doc["models"] = models
    if pretrain:
        doc["pretrain"] = pretrain
    doc["runs"] = list(rows)
    return doc


def nmt_models(
    bleu: dict[str, dict[str, float]], ce: dict[str, dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """The rows of nmt-domains' per-domain tables that are not servers (the pre-trained engine, each client
    alone): ``{model: {"bleu_by_domain": ..., "ce_by_domain": ...}}``."""
    out: dict[str, dict[str, Any]] = {}
    for name, scores in bleu.items():
        if not name.startswith("server "):
            out[name] = {"bleu_by_domain": scores}
            if name in ce:
                out[name]["ce_by_domain"] = ce[name]
    return out


def command_line(
    name: str,
    scale: str,
    seeds: Sequence[int],
    threads: int = 1,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    cohort: bool = False,
) -> str:
    """The command that runs an experiment with these arguments (``--out`` left out: it changes no number)."""
    parts = ["--scale", scale, "--seeds", ",".join(map(str, seeds))]
    if device != "cpu":
        parts += ["--device", device]
    if threads != 1 or device != "cpu":
        parts += ["--threads", str(threads)]
    if cohort:
        parts.append("--cohort")
    if not only and not overrides:
        return shlex.join(["fedmq", "experiment", name, *parts])
    if only:
        parts += ["--only", only]
    for key, value in (overrides or {}).items():
        parts += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return shlex.join(["python", "scripts/reproduce.py", name, *parts])


def git_commit(root: Path) -> tuple[str | None, bool]:
    """(HEAD's commit, whether tracked files differ from it) of the checkout at ``root``; (None, False) when
    ``root`` is not a git checkout (an installed package)."""
    if not (root / ".git").exists():
        return None, False
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        if head.returncode != 0:
            return None, False
        diff = subprocess.run(
            ["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None, False
    return head.stdout.strip(), diff.returncode == 1


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float as the string "inf", "-inf" or "nan" (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dumps(doc: dict[str, Any]) -> str:
    """The file's text: one key a line, one run a line (readable, and a diff shows the rows that changed)."""

    def one(value: Any) -> str:
        return json.dumps(_plain(value), ensure_ascii=False, allow_nan=False)

    lines = []
    for key, value in doc.items():
        if key == "runs" or (
            isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values())
        ):
            items = (
                [one(v) for v in value]
                if key == "runs"
                else [f"{one(k)}: {one(v)}" for k, v in value.items()]
            )
            opening, closing = ("[", "]") if key == "runs" else ("{", "}")
            lines.append(f"{one(key)}: {opening}\n  " + ",\n  ".join(items) + f"\n {closing}")
        else:
            lines.append(f"{one(key)}: {one(value)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def write(path: Path, doc: dict[str, Any]) -> None:
    write_atomic(path, dumps(doc))


def read(path: Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a results file ({FORMAT})")
    return doc


def merge(docs: Sequence[dict[str, Any]], command: str | None = None) -> dict[str, Any]:
    """One file of the rows of ``docs`` (one experiment and scale). The merged file's command (``command``,
    else the first file's), overrides and commit are the first file's; a row made otherwise keeps its own
    (``ROW_OWN``). Rows keep the order of ``docs``."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    for doc in docs:
        if (doc["experiment"], doc["scale"]) != (first["experiment"], first["scale"]):
            raise ValueError(
                f"cannot merge {doc['experiment']} at {doc['scale']} into "
                f"{first['experiment']} at {first['scale']}"
            )
    top = {"command": command or first["command"], "commit": first["commit"], "overrides": first["overrides"]}
    rows = []
    for doc in docs:
        for row in doc["runs"]:
            own = {k: row.get(k, doc[k]) for k in ROW_OWN}
            rows.append(
                {k: v for k, v in row.items() if k not in ROW_OWN}
                | {k: v for k, v in own.items() if v != top[k]}
            )
    models = next((d["models"] for d in docs if d.get("models")), None)
    pretrain = next((d["pretrain"] for d in docs if d.get("pretrain")), None)
    return document(
        first["experiment"],
        first["scale"],
        rows,
        top["command"],
        top["overrides"],
        top["commit"],
        dirty=any(d.get("dirty") for d in docs),
        models=models,
        pretrain=pretrain,
    )


def main(argv: list[str]) -> int:
    """``merge [--command TEXT] OUT IN [IN ...]``: the files IN as one file OUT (``merge``)."""
    command = None
    if argv[1:2] == ["--command"] and len(argv) > 2:
        command, argv = argv[2], argv[:1] + argv[3:]
    if len(argv) < 3 or argv[0] != "merge":
        print(
            "usage: python -m fedmq.benchmarks.results_file merge [--command TEXT] OUT IN [IN ...]",
            file=sys.stderr,
        )
        return 2
    try:
        write(Path(argv[1]), merge([read(Path(p)) for p in argv[2:]], command))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
