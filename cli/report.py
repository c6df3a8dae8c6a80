"""`fedmq report`: read run folders (config.json, metrics.jsonl, summary.json) and write PNG figures,
one self-contained HTML page (figures embedded as data URIs, inline CSS) and a markdown table of final scores.

Loading validates everything before anything is written, so a bad run folder raises one
:class:`ReportError` and leaves the output folder untouched. Malformed lines in metrics.jsonl are
skipped and counted (a run killed mid-write leaves a torn last line), never fatal on their own.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fedmq.aggregator.records import is_number
from fedmq.aggregator.runlog import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from fedmq.cli.runs import ReportError, RunData, load_runs
from fedmq.files import write_atomic

log = structlog.get_logger(__name__)

# Config keys shown first in the per-run summary; the rest follow alphabetically.
_CONFIG_FIRST = (
    "task",
    "data",
    "corpus",
    "model",
    "strategy",
    "clients",
    "fraction",
    "rounds",
    "encoding",
    "down_encoding",
    "seed",
    "job",
)


@dataclass
class Score:
    """The final-scores line of one run, from summary.json or, for an incomplete run, from its rows."""

    run: str
    strategy: str
    metric: str
    best_valid: float | None
    best_round: int | None
    final_valid: float | None
    test: float | None
    rounds_completed: int
    rounds_planned: int | None
    rounds_skipped: int
    bytes_up: float | None
    bytes_down: float | None
    wall_s: float | None
    complete: bool


@dataclass
class ReportResult:
    """What `build_report` wrote. ``figures`` maps a figure key (e.g. ``validation``) to its PNG."""

    out_dir: Path
    html: Path
    markdown: Path
    figures: dict[str, Path]
    scores: list[Score]
    malformed_lines: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [self.html, self.markdown, *self.figures.values()]

    def describe(self) -> str:
        """One line for the CLI to print."""
        skipped = sum(self.malformed_lines.values())
        extra = f"; skipped {skipped} malformed metrics line(s)" if skipped else ""
        return f"report written to {self.html} ({len(self.figures)} figures){extra}"


def _opt_int(value: Any) -> int | None:
    return int(value) if is_number(value) and math.isfinite(value) else None


def _opt_float(value: Any) -> float | None:
    return float(value) if is_number(value) else None


def score_of(run: RunData) -> Score:
    """Final scores: summary.json wins where it has a field; otherwise computed from the rows."""
    evaluated = [(r.round, r.valid) for r in run.rows if r.valid is not None and not math.isnan(r.valid)]
    best_round = best_valid = None
    if evaluated:
        pick = max if run.higher_is_better else min
        best_round, best_valid = pick(evaluated, key=lambda rv: rv[1])
    final_valid = evaluated[-1][1] if evaluated else None
    done = [r for r in run.rows if not r.skipped]
    summary = run.summary or {}

    def total(key: str) -> float | None:
        values = [getattr(r, key) for r in run.rows if getattr(r, key) is not None]
        return sum(values) if values else None

    return Score(
        run=run.name,
        strategy=run.strategy,
        metric=run.metric,
        best_valid=_opt_float(summary.get("best_valid", best_valid)),
        best_round=_opt_int(summary.get("best_round", best_round)),
        final_valid=final_valid,
        test=_opt_float(summary.get("test")),
        rounds_completed=_opt_int(summary.get("rounds_completed")) or len(done),
        rounds_planned=_opt_int(run.config.get("rounds")),
        rounds_skipped=_opt_int(summary.get("rounds_skipped")) or sum(r.skipped for r in run.rows),
        bytes_up=_opt_float(summary.get("bytes_up", total("bytes_up"))),
        bytes_down=_opt_float(summary.get("bytes_down", total("bytes_down"))),
        wall_s=_opt_float(summary.get("wall_s", total("wall_s"))),
        complete=run.complete,
    )


def fmt_value(value: float | None, digits: int = 2) -> str:
    """A metric value for tables: fixed decimals, "—" when absent, inf/nan spelled out."""
    if value is None:
        return "—"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:,.{digits}f}"


def fmt_bytes(value: float | None) -> str:
    """Bytes as MB (10^6), the unit used in the tables and the bytes figure."""
    return "—" if value is None else f"{value / 1e6:,.2f}"


SCORE_HEADERS = [
    "run",
    "strategy",
    "metric",
    "best valid (round)",
    "final valid",
    "test",
    "rounds",
    "skipped",
    "MB up",
    "MB down",
    "wall s",
    "status",
]


def score_cells(score: Score) -> list[str]:
    best = fmt_value(score.best_valid)
    if score.best_round is not None and score.best_valid is not None:
        best += f" ({score.best_round})"
    planned = f"/{score.rounds_planned}" if score.rounds_planned is not None else ""
    return [
        score.run,
        score.strategy,
        score.metric,
        best,
        fmt_value(score.final_valid),
        fmt_value(score.test),
        f"{score.rounds_completed}{planned}",
        str(score.rounds_skipped),
        fmt_bytes(score.bytes_up),
        fmt_bytes(score.bytes_down),
        fmt_value(score.wall_s, 1),
        "complete" if score.complete else "incomplete",
    ]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(scores: list[Score]) -> str:
    """The final-scores table as GitHub markdown (numbers right-aligned)."""
    align = ["---", "---", "---"] + ["---:"] * (len(SCORE_HEADERS) - 4) + ["---"]
    lines = ["| " + " | ".join(SCORE_HEADERS) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_md_escape(c) for c in score_cells(s)) + " |" for s in scores]
    return "\n".join(lines) + "\n"


def run_notes(runs: list[RunData]) -> list[str]:
    """Plain-text remarks the reader must see: incomplete runs, skipped or replaced rows."""
    notes = []
    for run in runs:
        if not run.complete:
            last = run.rows[-1].round
            notes.append(
                f"{run.name}: no {SUMMARY_FILE} — the run is still going or was stopped; "
                f"showing {len(run.rows)} round(s) up to round {last}."
            )
        if run.malformed_lines:
            notes.append(f"{run.name}: skipped {run.malformed_lines} malformed line(s) in {METRICS_FILE}.")
        if run.duplicate_rounds:
            notes.append(
                f"{run.name}: {run.duplicate_rounds} round(s) were logged twice (resumed run); "
                "the last entry of each is shown."
            )
        if not run.config:
            notes.append(f"{run.name}: no {CONFIG_FILE}; configuration unknown.")
        private = [r for r in run.rows if r.delta is not None]
        if private:  # under DP the rows hold no client's loss or weight: ε instead
            eps = private[-1].epsilon
            spent = "unbounded (no noise)" if eps is None else f"{eps:.3g}"
            notes.append(
                f"{run.name}: client-level differential privacy, ε = {spent} at δ = {private[-1].delta:.3g} "
                f"after round {private[-1].round}; no client's loss or weight is recorded."
            )
    return notes


def config_items(config: dict[str, Any], limit: int = 80) -> list[tuple[str, str]]:
    """The run configuration as (key, short text) pairs, most telling keys first."""
    keys = [k for k in _CONFIG_FIRST if k in config] + sorted(k for k in config if k not in _CONFIG_FIRST)
    items = []
    for key in keys:
        value = config[key]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        items.append((str(key), text if len(text) <= limit else text[: limit - 1] + "…"))
    return items


# ---------------------------------------------------------------------------------------------- output


_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;\
margin:0;background:#f6f7f9;color:#1d232b}
main{max-width:1200px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:24px;margin:4px 0 2px}\
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d5d9e0;padding-bottom:4px}
.sub{color:#5b6573;font-size:13px;margin:0 0 12px}
table{border-collapse:collapse;font-size:13px;background:#fff;margin:4px 0 8px}
th,td{border:1px solid #d5d9e0;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.notes{background:#fff8e1;border-left:4px solid #e69f00;padding:8px 14px;margin:12px 0;font-size:13px}
.notes li{margin:2px 0}
.configs{display:flex;flex-wrap:wrap;gap:14px}.configs table{min-width:260px}\
.configs caption{text-align:left;font-weight:600;padding:2px 0}
figure{background:#fff;border:1px solid #d5d9e0;margin:10px 0 18px;padding:10px}
figure img{max-width:100%;height:auto;display:block;margin:0 auto}
figcaption{font-size:13px;color:#3d4652;margin-top:6px}
.complete{color:#007a5a;font-weight:600}.incomplete{color:#b34700;font-weight:600}
"""


def _html_table(
    headers: list[str], rows: list[list[str]], numeric: set[int], status_col: int | None = None
) -> str:
    out = ["<table><thead><tr>", *(f"<th>{html.escape(h)}</th>" for h in headers), "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            if i == status_col:
                cls = f' class="{html.escape(cell)}"'
            out.append(f"<td{cls}>{html.escape(cell)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_html(
    runs: list[RunData], scores: list[Score], figures: list[tuple[str, str, Path]], notes: list[str]
) -> str:
    """The self-contained page: every figure is embedded as a base64 data URI and linked to its file."""
    title = "fedmq report — " + ", ".join(r.name for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">{len(runs)} run(s): ' + "; ".join(html.escape(str(r.path)) for r in runs) + "</p>",
    ]
    if notes:
        parts.append(
            '<div class="notes"><ul>' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul></div>"
        )
    parts.append("<h2>Final scores</h2>")
    numeric = {3, 4, 5, 6, 7, 8, 9, 10}
    parts.append(_html_table(SCORE_HEADERS, [score_cells(s) for s in scores], numeric, status_col=11))
    parts.append(
        '<p class="sub">best valid: best validation value and its round; MB = 10<sup>6</sup> bytes '
        "on the wire (compressed), summed over rounds.</p>"
    )
    for key, caption, path in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f'<figure id="fig-{html.escape(key)}"><img src="data:image/png;base64,{data}" '
            f'alt="{html.escape(caption)}" data-file="{html.escape(path.name)}">'
            f'<figcaption>{html.escape(caption)} — <a href="{html.escape(path.name)}">'
            f"{html.escape(path.name)}</a></figcaption></figure>"
        )
    parts.append('<h2>Configuration</h2><div class="configs">')
    for run in runs:
        items = config_items(run.config) or [("config", "unknown (no config.json)")]
        parts.append(
            f"<table><caption>{html.escape(run.name)}</caption><tbody>"
            + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in items)
            + "</tbody></table>"
        )
    parts.append("</div></main></body></html>")
    return "\n".join(parts)


def render_markdown(
    runs: list[RunData], scores: list[Score], figures: list[tuple[str, str, Path]], notes: list[str]
) -> str:
    lines = ["# fedmq report", "", "## Final scores", "", markdown_table(scores).rstrip(), ""]
    if notes:
        lines += ["## Notes", "", *(f"- {_md_escape(n)}" for n in notes), ""]
    lines += ["## Figures", "", *(f"- [{_md_escape(c)}]({p.name})" for _, c, p in figures), ""]
    return "\n".join(lines)


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportError(f"report output {out_dir} exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot create report folder {out_dir}: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK):
        raise ReportError(f"report folder {out_dir} is not writable")


def build_report(run_dirs: list[Path], out_dir: Path) -> ReportResult:
    """Write the figures (PNG), report.html and report.md for one or several runs into ``out_dir``."""
    from fedmq.cli import plots  # matplotlib is only imported when a report is really drawn

    runs = load_runs(run_dirs)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir)
    scores = [score_of(r) for r in runs]
    notes = run_notes(runs)

    drawn: list[tuple[str, str, Any]] = [
        (
            "validation",
            "Validation metric and mean reported training loss per round",
            plots.plot_validation(runs),
        ),
        ("bytes", "Bytes on the wire per round (compressed vs raw fp32)", plots.plot_bytes(runs)),
    ]
    for run in runs:
        drawn.append(
            (
                f"participation-{run.slug}",
                f"Participation per round — {run.label}",
                plots.plot_participation(run),
            )
        )
    if plots.has_privacy(runs):
        drawn.append(
            (
                "privacy",
                "Privacy spent: ε per round (client-level, at each run's δ)",
                plots.plot_privacy(runs),
            )
        )
    for run in runs:
        if plots.has_weights(run):
            drawn.append(
                (
                    f"weights-{run.slug}",
                    f"Aggregation weight per client and round — {run.label}",
                    plots.plot_weights(run),
                )
            )
    figures: list[tuple[str, str, Path]] = []
    for key, caption, fig in drawn:
        path = out_dir / f"{key}.png"
        plots.save_png(fig, path)
        figures.append((key, caption, path))

    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    write_atomic(md_path, render_markdown(runs, scores, figures, notes))  # a reader never sees half a page
    write_atomic(html_path, render_html(runs, scores, figures, notes))
    result = ReportResult(
        out_dir=out_dir,
        html=html_path,
        markdown=md_path,
        figures={k: p for k, _, p in figures},
        scores=scores,
        malformed_lines={r.name: r.malformed_lines for r in runs if r.malformed_lines},
        notes=notes,
    )
    log.info("report written", out=str(out_dir), runs=len(runs), figures=len(figures))
    return result


def run_report(run_dirs: list[Path] | list[str], out_dir: Path | str | None = None) -> ReportResult:
    """What `fedmq report RUN_DIR... [--out DIR]` calls. Without ``out_dir`` the report goes to
    RUN_DIR/report for one run, and to ./report for several."""
    paths = [Path(p) for p in run_dirs]
    if out_dir is None:
        out_dir = paths[0] / "report" if len(paths) == 1 else Path("report")
    return build_report(paths, Path(out_dir))
