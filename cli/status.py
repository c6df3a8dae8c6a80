"""Terminal views: `fedmq status` (rich tables or JSON) and the per-round table printed at the end of a
simulation.

The status ``info`` dict comes from cli.status_info.gather or the aggregator engine's ``status()``; every
key is optional, since a status probe must still say something useful about a half-started job.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from fedmq.aggregator.records import is_number
from fedmq.errors import FedmqError

DASH = "—"


class StatusError(FedmqError):
    """The status or summary data handed to a renderer is not a mapping; the message is one line."""


def _require_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StatusError(f"{what} must be a mapping, not {type(value).__name__}")
    return value


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return DASH
    if not is_number(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return f"{value:,.{digits}f}"


def _mb(value: Any) -> str:
    return f"{value / 1e6:,.2f}" if is_number(value) and math.isfinite(value) else DASH


def _count(value: Any) -> str:
    return str(len(value)) if isinstance(value, (list, tuple, set, dict)) else DASH


def _names(value: Any, limit: int = 12) -> str:
    if not isinstance(value, (list, tuple, set)):
        return DASH if value is None else str(value)
    names = sorted(str(v) for v in value)
    shown = ", ".join(names[:limit])
    return shown + (f", … (+{len(names) - limit})" if len(names) > limit else "")


def _nonzero(counts: Any) -> str:
    if not isinstance(counts, dict):
        return DASH
    items = [f"{k} {v}" for k, v in sorted(counts.items()) if v]
    return ", ".join(items) if items else "none"


def to_text(*renderables: Any, width: int = 100, color: bool = False) -> str:
    """Render rich objects to a string (plain text unless ``color``), for typer.echo or tests."""
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width,
        force_terminal=color,
        color_system="standard" if color else None,
        no_color=not color,
        highlight=False,
    )
    for item in renderables:
        console.print(item)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- fedmq status


def status_tables(info: dict[str, Any]) -> list[Table]:
    """The job overview, its last round and the queue depths, as rich tables."""
    info = _require_dict(info, "status info")
    job = info.get("job") or "?"
    overview = Table(title=f"fedmq status — job {job}", show_header=False, title_justify="left", min_width=60)
    overview.add_column("what", style="bold")
    overview.add_column("value")
    aggregators = info.get("aggregators")
    standby = info.get("standby_waiting")
    agg_text = DASH if aggregators is None else str(aggregators)
    if standby is not None:
        agg_text += " (a hot standby is waiting)" if standby else " (no standby)"
    online = info.get("agents_online")
    for label, value in (
        ("phase", info.get("phase") or DASH),
        ("round", _num(info.get("round"))),
        ("model version", _num(info.get("version"))),
        ("aggregators", agg_text),
        (
            "agents online",
            f"{info.get('agents_online_count', _count(online))}: {_names(online)}"
            if isinstance(online, (list, tuple, set))
            else DASH,
        ),
        ("privacy spent", _privacy(info)),
        ("messages rejected", _nonzero(info.get("rejected")) if "rejected" in info else None),
        ("messages dropped", _nonzero(info.get("dropped")) if "dropped" in info else None),
        (  # by sender: who floods the inbox with presence (aggregator.presence_budget)
            "presence over budget",
            _nonzero(info.get("presence_over_budget")) if info.get("presence_over_budget") else None,
        ),
    ):
        if value is not None:
            overview.add_row(label, value)
    broker = info.get("broker")
    if isinstance(broker, dict):
        for key, value in sorted(broker.items()):
            overview.add_row(
                f"broker {key}", value if isinstance(value, str) else json.dumps(_jsonable(value))
            )

    tables = [overview]
    row = info.get("last_metrics")
    if isinstance(row, dict) and row:
        last = Table(
            title=f"last round ({_num(row.get('round'))})",
            show_header=False,
            title_justify="left",
            min_width=60,
        )
        last.add_column("what", style="bold")
        last.add_column("value")
        metric = row.get("metric") or "valid"
        last.add_row("strategy", str(row.get("strategy") or DASH))
        last.add_row(f"validation {metric}", _num(row.get("valid")))
        last.add_row("mean client loss", _num(row.get("mean_loss"), 4))
        last.add_row(
            "selected / reported / received",
            " / ".join(_count(row.get(k)) for k in ("selected", "reported", "received")),
        )
        last.add_row("dropped", _names(row.get("dropped")))
        last.add_row("MB up / down", f"{_mb(row.get('bytes_up'))} / {_mb(row.get('bytes_down'))}")
        last.add_row("round wall time (s)", _num(row.get("wall_s"), 1))
        if _privacy(row):
            last.add_row("privacy spent", _privacy(row) or DASH)
        if row.get("skipped"):
            last.add_row("skipped", str(row.get("skip_reason") or "yes"))
        tables.append(last)
    depths = info.get("queue_depths")
    if isinstance(depths, dict) and depths:
        queues = Table(title="queue depths", title_justify="left")
        queues.add_column("queue")
        queues.add_column("messages", justify="right")
        for name, depth in sorted(depths.items()):
            queues.add_row(str(name), _num(depth) if depth is not None else DASH)
        tables.append(queues)
    return tables


def render_status(info: dict[str, Any], *, width: int = 100, color: bool = False) -> str:
    """`fedmq status` for people: the overview, last round and queue depth tables as text."""
    return to_text(*status_tables(info), width=width, color=color)


def _jsonable(value: Any) -> Any:
    """Plain JSON values: sets become sorted lists, paths strings, non-finite floats null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Path):
        return str(value)
    return str(value)


def status_json(info: dict[str, Any]) -> str:
    """`fedmq status --json`: one line of strict JSON (no NaN), keys sorted."""
    return json.dumps(_jsonable(_require_dict(info, "status info")), sort_keys=True, allow_nan=False)


# ------------------------------------------------------------------------------------------- simulate summary


# Short headers so the table fits an 80-column terminal; the caption spells the metric out.
SUMMARY_COLUMNS = [
    "round",
    "strategy",
    "valid",
    "loss",
    "online",
    "sel.",
    "recv.",
    "drop.",
    "MB up",
    "MB dn",
    "wall s",
]
_SHORT_METRIC = {"perplexity": "ppl", "accuracy": "acc"}


def _summary_row(row: dict[str, Any]) -> list[str]:
    valid = "skipped" if row.get("skipped") else _num(row.get("valid"))
    return [
        _num(row.get("round")),
        _short_strategy(row.get("strategy")),
        valid,
        _num(row.get("mean_loss"), 3),
        _num(row["online_count"]) if row.get("online_count") is not None else _count(row.get("online")),
        _count(row.get("selected")),
        _count(row.get("received")),
        _count(row.get("dropped")),
        _mb(row.get("bytes_up")),
        _mb(row.get("bytes_down")),
        _num(row.get("wall_s"), 1),
    ]


def _short_strategy(name: Any) -> str:
    """A strategy named by import path (package.module:Class) shows as its class; the title has it in full."""
    text = str(name or DASH)
    return text.rpartition(":")[2] or text


def _privacy(info: dict[str, Any]) -> str | None:
    """ε spent and δ of a DP run's status, row or summary ("ε = ∞" while z = 0); None without DP."""
    delta = info.get("delta")
    if not isinstance(delta, (int, float)) or isinstance(delta, bool):
        return None
    eps = info.get("epsilon")
    return f"ε = {_num(eps, 3) if eps is not None else '∞'} at δ = {delta:.3g}"


def summary_caption(summary: dict[str, Any]) -> str:
    metric = summary.get("metric") or "score"
    parts = [
        f"best valid {metric} {_num(summary.get('best_valid'))} (round {_num(summary.get('best_round'))})",
        f"test {metric} {_num(summary.get('test'))}",
        f"{_num(summary.get('rounds_completed'))} rounds completed, "
        f"{_num(summary.get('rounds_skipped'))} skipped",
        f"{_mb(summary.get('bytes_up'))} MB up, {_mb(summary.get('bytes_down'))} MB down",
        f"{_num(summary.get('wall_s'), 1)} s",
    ]
    guard = summary.get("guard")
    if isinstance(guard, dict) and guard.get("rounds"):  # a departure from textbook FedAvg: said, not silent
        acted = [f"capped {guard.get('capped', 0)} update(s)"] if guard.get("capped") else []
        acted += [f"left out {guard.get('dropped', 0)} update(s)"] if guard.get("dropped") else []
        parts.append(
            f"influence guard {' and '.join(acted) or 'acted'} in {guard['rounds']} round(s) "
            "(--max-samples-factor 0 turns the cap off)"
        )
    if _privacy(summary):
        dp = summary.get("dp") if isinstance(summary.get("dp"), dict) else {}
        seeded = (
            " (noise seeded from the job's seed: a simulation)" if "seeded" in str(dp.get("noise")) else ""
        )
        stop = "; the target ε stopped the job" if summary.get("budget_spent") else ""
        parts.append(f"client-level DP {dp.get('mode', '')}: {_privacy(summary)}{seeded}{stop}")
    if summary.get("inbox_left"):  # late presence and reports: the broker keeps them until purged
        parts.append(f"{summary['inbox_left']} message(s) left in the inbox (remove: fedmq broker purge)")
    if summary.get("interrupted"):
        parts.append("interrupted")
    return " · ".join(parts)


def render_summary(summary: dict[str, Any], rows: Iterable[dict[str, Any]], *, max_rows: int = 30) -> Table:
    """The table printed at the end of `fedmq simulate`: one line per round, the run's scores as caption.

    With more than ``max_rows`` rounds the middle ones are elided (first and last rounds stay visible).
    """
    summary = _require_dict(summary, "run summary")
    rows = [_require_dict(r, "metrics row") for r in rows]
    metric = summary.get("metric") or next((r.get("metric") for r in rows if r.get("metric")), "score")
    strategy = summary.get("strategy")
    title = "fedmq run" + (f" — {strategy}" if strategy else "")
    table = Table(
        title=title,
        caption=summary_caption({**summary, "metric": metric}),
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        padding=0,
        pad_edge=False,
        show_edge=False,
    )
    for name in SUMMARY_COLUMNS:
        header = f"valid {_SHORT_METRIC.get(metric, metric)}" if name == "valid" else name
        if name == "strategy":  # the one column that gives way at 80 columns: it wraps, the numbers never do
            table.add_column(header, justify="left", overflow="fold", min_width=6)
        else:
            table.add_column(header, justify="right", no_wrap=True)
    if max_rows > 1 and len(rows) > max_rows:
        head, tail = rows[: max_rows // 2], rows[-(max_rows - max_rows // 2 - 1) :]
        for row in head:
            table.add_row(*_summary_row(row))
        table.add_row("…", f"{len(rows) - len(head) - len(tail)} more", *[""] * (len(SUMMARY_COLUMNS) - 2))
        rows = tail
    best = summary.get("best_round")
    for row in rows:
        table.add_row(
            *_summary_row(row), style="bold" if best is not None and row.get("round") == best else None
        )
    return table
