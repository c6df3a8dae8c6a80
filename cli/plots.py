"""The report's figures, one function per figure, drawn with matplotlib's Agg canvas (no pyplot, no display).

Colours follow the Okabe–Ito palette (distinguishable with the common colour-vision deficiencies);
heatmaps use viridis. Legends sit outside the data area.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless everywhere; harmless if the caller already chose Agg

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from fedmq.aggregator.records import RoundRecord
from fedmq.cli.runs import RunData
from fedmq.files import replacing

OKABE_ITO = {
    "blue": "#0072B2",
    "orange": "#E69F00",
    "green": "#009E73",
    "vermillion": "#D55E00",
    "purple": "#CC79A7",
    "sky": "#56B4E9",
    "yellow": "#F0E442",
    "black": "#000000",
}
RUN_COLORS = [OKABE_ITO[c] for c in ("blue", "orange", "green", "vermillion", "purple", "sky", "black")]
RUN_STYLES = ["-", "--", "-.", ":"]
STRATEGY_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]

# Participation states, in drawing order (index = value in the grid).
STATES = [
    ("not logged", "#FFFFFF"),
    ("offline", "#D9D9D9"),
    ("online, not selected", OKABE_ITO["sky"]),
    ("selected, dropped", OKABE_ITO["vermillion"]),
    ("reported, not uploaded", OKABE_ITO["yellow"]),
    ("uploaded & folded", OKABE_ITO["green"]),
]
NOT_LOGGED, OFFLINE, ONLINE, DROPPED, REPORTED, UPLOADED = range(len(STATES))

WIDTH_IN = 11.0
DPI = 100


def _run_style(i: int) -> dict[str, Any]:
    return {"color": RUN_COLORS[i % len(RUN_COLORS)], "linestyle": RUN_STYLES[(i // len(RUN_COLORS)) % 4]}


def _new_figure(height_in: float) -> Figure:
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _style(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20, min_n_ticks=1))


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _wants_log(values: list[float], ratio: float) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and len(positive) > 1 and max(positive) / min(positive) > ratio


def save_png(fig: Figure, path: Path) -> Path:
    """Render ``fig`` to ``path`` (through a temporary file, so a reader never sees half an image)."""
    path = Path(path)
    with replacing(path) as fh:
        fig.savefig(fh, format="png", dpi=DPI, metadata={"Software": "fedmq report"})
    return path


# ------------------------------------------------------------------------------------ (1) validation


def plot_validation(runs: list[RunData]) -> Figure:
    """Validation metric per round (one panel per metric, one line per run) and the mean reported loss.

    Marker shape shows the strategy actually applied in that round (e.g. FedMed falling back to FedAvg
    after the loss switch); a star marks each run's best round.
    """
    metrics = list(dict.fromkeys(r.metric for r in runs))
    fig = _new_figure(3.3 * (len(metrics) + 1))
    axes = fig.subplots(len(metrics) + 1, 1, sharex=True)
    marker_of = _strategy_markers(runs)
    for ax, metric in zip(axes, metrics):
        _plot_metric(ax, metric, [(i, r) for i, r in enumerate(runs) if r.metric == metric], marker_of)
    _plot_mean_loss(axes[-1], runs)
    fig.legend(
        handles=_validation_legend(runs, marker_of), loc="outside right upper", fontsize=9, frameon=False
    )
    return fig


def _strategy_markers(runs: list[RunData]) -> dict[str, str]:
    """A marker shape per strategy applied, when a run applied more than one (FedMed's loss switch to FedAvg);
    otherwise every round is a dot: the run's legend label already names its one strategy, and a marker entry
    per strategy would only say it twice."""
    switched = any(len({row.strategy for row in r.rows if row.strategy}) > 1 for r in runs)
    if not switched:
        return {}
    strategies = list(dict.fromkeys(row.strategy for r in runs for row in r.rows if row.strategy))
    return {s: STRATEGY_MARKERS[i % len(STRATEGY_MARKERS)] for i, s in enumerate(strategies)}


def _plot_metric(ax: Any, metric: str, members: list[tuple[int, RunData]], marker_of: dict[str, str]) -> None:
    """One validation panel: a line per run, its rounds marked by the strategy applied, a star at its best."""
    all_values: list[float] = []
    for i, run in members:
        pts = [
            (row.round, row.valid, row.strategy)
            for row in run.rows
            if row.valid is not None and math.isfinite(row.valid)
        ]
        if not pts:
            continue
        style = _run_style(i)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        all_values += ys
        ax.plot(xs, ys, label=run.label, linewidth=1.8, **style)
        for strategy in dict.fromkeys(p[2] for p in pts):
            sel = [(x, y) for x, y, s in pts if s == strategy]
            ax.scatter(
                [x for x, _ in sel],
                [y for _, y in sel],
                marker=marker_of.get(strategy, "o"),
                s=28,
                color=style["color"],
                zorder=3,
                edgecolors="white",
                linewidths=0.5,
            )
        best = (max if run.higher_is_better else min)(pts, key=lambda p: p[1])
        ax.scatter(
            [best[0]],
            [best[1]],
            marker="*",
            s=180,
            color=style["color"],
            edgecolors="black",
            linewidths=0.7,
            zorder=4,
        )
    if not all_values:
        _empty(ax, f"no {metric} values logged yet")
        return
    if _wants_log(all_values, 10):
        ax.set_yscale("log")
    better = "higher is better" if members[0][1].higher_is_better else "lower is better"
    ax.set_title(f"Validation {metric} per round ({better})", loc="left", fontsize=11)
    ax.set_ylabel(f"validation {metric}")
    _style(ax)


def _plot_mean_loss(ax: Any, runs: list[RunData]) -> None:
    """The bottom panel: the mean training loss the clients reported, a line per run."""
    any_loss = False
    for i, run in enumerate(runs):
        pts = [
            (row.round, row.mean_loss)
            for row in run.rows
            if row.mean_loss is not None and math.isfinite(row.mean_loss)
        ]
        if pts:
            any_loss = True
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=run.label, **_run_style(i))
    if any_loss:
        ax.set_title("Mean training loss reported by the clients", loc="left", fontsize=11)
        ax.set_ylabel("mean client loss (nats/token)")
        _style(ax)
    else:
        _empty(ax, "no client losses logged")
    ax.set_xlabel("round")


def _validation_legend(runs: list[RunData], marker_of: dict[str, str]) -> list[Line2D]:
    """The runs, the strategies' markers and the best-round star."""
    handles = [Line2D([], [], linewidth=1.8, label=r.label, **_run_style(i)) for i, r in enumerate(runs)]
    handles += [
        Line2D([], [], linestyle="none", marker=m, color="#444444", label=f"round used {s}")
        for s, m in marker_of.items()
    ]
    handles.append(
        Line2D(
            [],
            [],
            linestyle="none",
            marker="*",
            markersize=12,
            color="#444444",
            markeredgecolor="black",
            label="best round",
        )
    )
    return handles


# ------------------------------------------------------------------------------------ (2) bytes on the wire


# (key, label, colour, line style, marker). Raw fp32 up and down are often the same bytes (the selected
# clients each fetch and send one model), so their dots are offset to interleave and their markers point
# apart: a line drawn on top of an equal one never hides it.
_BYTE_SERIES = [
    ("bytes_up", "up (on the wire)", OKABE_ITO["blue"], "-", "^"),
    ("bytes_down", "down (on the wire)", OKABE_ITO["orange"], "-", "v"),
    ("bytes_up_raw", "up (raw fp32)", OKABE_ITO["blue"], (0, (1, 3)), "^"),
    ("bytes_down_raw", "down (raw fp32)", OKABE_ITO["orange"], (2, (1, 3)), "v"),
]


def _ratio_text(run: RunData) -> str:
    parts = []
    for direction in ("up", "down"):
        wire = sum(_finite([getattr(row, f"bytes_{direction}") for row in run.rows]))
        raw = sum(_finite([getattr(row, f"bytes_{direction}_raw") for row in run.rows]))
        if wire > 0 and raw > 0:
            ratio = raw / wire
            parts.append(f"{direction} {ratio:.1f}× smaller" if ratio >= 1.05 else f"{direction} no smaller")
    up, down = run.config.get("encoding"), run.config.get("down_encoding")
    prefix = f"encoding {up}: " if isinstance(up, str) else ""
    if isinstance(up, str) and isinstance(down, str) and down != up:
        prefix = f"encoding up {up}, down {down}: "
    return f" — {prefix}{', '.join(parts)} than raw fp32" if parts else ""


def plot_bytes(runs: list[RunData]) -> Figure:
    """Bytes on the wire per round, one panel per run: up/down compressed (solid) vs raw fp32 (dotted), MB."""
    fig = _new_figure(max(3.2, 2.9 * len(runs)))
    axes = np.atleast_1d(fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0])
    values = [
        v / 1e6
        for run in runs
        for key, *_ in _BYTE_SERIES
        for v in _finite([getattr(row, key) for row in run.rows])
    ]
    log_scale = _wants_log(values, 20) if values else False
    for ax, run in zip(axes, runs):
        drawn = False
        for key, label, color, style, marker in _BYTE_SERIES:
            values = [(row.round, getattr(row, key)) for row in run.rows]
            pts = [(rnd, v / 1e6) for rnd, v in values if v is not None and math.isfinite(v)]
            if pts:
                drawn = True
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    linestyle=style,
                    marker=marker,
                    markersize=5,
                    markerfacecolor="none" if style != "-" else color,
                    linewidth=1.8 if style == "-" else 1.3,
                    label=label,
                )
        if not drawn:
            _empty(ax, f"{run.label}: no byte counts logged")
            continue
        ax.set_title(f"{run.label}{_ratio_text(run)}", loc="left", fontsize=11)
        ax.set_ylabel("MB per round (10⁶ bytes)")
        if log_scale:
            ax.set_yscale("log")
        _style(ax)
    axes[-1].set_xlabel("round")
    handles = [
        Line2D([], [], color=c, linestyle=s, marker=m, markerfacecolor="none" if s != "-" else c, label=lbl)
        for _, lbl, c, s, m in _BYTE_SERIES
    ]
    fig.legend(
        handles=handles,
        loc="outside right upper",
        fontsize=9,
        frameon=False,
        title="all clients, summed",
        title_fontsize=9,
    )
    fig.suptitle("Bytes on the wire per round", x=0.01, ha="left", fontsize=12, fontweight="bold")
    return fig


# ------------------------------------------------------------------------------------ (3) participation


def client_state(row: RoundRecord, client: str) -> int:
    """The participation state of ``client`` in one round (see STATES).

    The aggregator logs ``dropped`` as selected minus received, which also holds the reporters that the
    top-K mediation did not grant; those are shown as "reported, not uploaded", not as dropouts.
    """
    if client in row.received:
        return UPLOADED
    if client in row.granted:  # allowed (or, without a grant phase, expected) to upload; nothing came
        return DROPPED
    if client in row.reported:  # reported a loss but was not granted (top-K) or the round closed first
        return REPORTED
    if client in row.selected or client in row.dropped:
        return DROPPED
    if client in row.online:
        return ONLINE
    return OFFLINE


def participation_grid(run: RunData) -> tuple[list[str], list[int], np.ndarray]:
    """(clients, rounds, grid[client, round] of state indices); rounds with no row are NOT_LOGGED."""
    clients = run.clients()
    first, last = run.rows[0].round, run.rows[-1].round
    rounds = list(range(first, last + 1))
    by_round = {row.round: row for row in run.rows}
    grid = np.full((len(clients), len(rounds)), NOT_LOGGED, dtype=int)
    for j, rnd in enumerate(rounds):
        row = by_round.get(rnd)
        if row is not None:
            for i, client in enumerate(clients):
                grid[i, j] = client_state(row, client)
    return clients, rounds, grid


def plot_participation(run: RunData) -> Figure:
    """Who was online each round: a client × round grid coloured by state, and stacked counts per round."""
    clients, rounds, grid = participation_grid(run)
    grid_h = min(12.0, max(1.6, 0.22 * len(clients)))
    fig = _new_figure(grid_h + 3.2)
    ax_grid, ax_bar = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [grid_h, 2.6]})
    cmap = ListedColormap([c for _, c in STATES])
    norm = BoundaryNorm(np.arange(len(STATES) + 1) - 0.5, len(STATES))
    x0, x1 = rounds[0] - 0.5, rounds[-1] + 0.5
    if clients:
        ax_grid.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            norm=norm,
            extent=(x0, x1, len(clients) - 0.5, -0.5),
        )
        step = max(1, math.ceil(len(clients) / 40))
        ax_grid.set_yticks(range(0, len(clients), step), clients[::step], fontsize=8)
        if len(rounds) <= 60 and len(clients) <= 60:  # thin separators keep cells countable
            ax_grid.set_xticks(np.arange(x0, x1 + 1), minor=True)
            ax_grid.set_yticks(np.arange(-0.5, len(clients)), minor=True)
            ax_grid.grid(which="minor", color="white", linewidth=0.6)
            ax_grid.tick_params(which="minor", length=0)
    else:
        _empty(ax_grid, "no client ids logged")
    ax_grid.set_ylabel("client")
    ax_grid.set_title(f"Participation timeline — {run.label}", loc="left", fontsize=11)
    ax_grid.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20, min_n_ticks=1))

    bottom = np.zeros(len(rounds))
    for state in (UPLOADED, REPORTED, DROPPED, ONLINE, OFFLINE):
        counts = (grid == state).sum(axis=0)
        if counts.any():
            ax_bar.bar(
                rounds,
                counts,
                bottom=bottom,
                width=0.8,
                color=STATES[state][1],
                edgecolor="#888888" if state == OFFLINE else "none",
                linewidth=0.4,
            )
            bottom += counts
    skipped = [row.round for row in run.rows if row.skipped]
    for rnd in skipped:
        ax_bar.annotate(
            "skipped",
            (rnd, 0),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=7,
            rotation=90,
            color="#333333",
        )
    ax_bar.set_xlim(x0, x1)
    ax_bar.set_ylabel("clients")
    ax_bar.set_xlabel("round")
    ax_bar.set_title("Clients per state each round", loc="left", fontsize=10)
    _style(ax_bar)
    ax_bar.yaxis.set_major_locator(MaxNLocator(integer=True))
    present = set(np.unique(grid).tolist())
    handles = [
        Patch(facecolor=c, edgecolor="#888888", label=name)
        for k, (name, c) in enumerate(STATES)
        if k != NOT_LOGGED or k in present
    ]
    fig.legend(
        handles=handles, loc="outside right upper", fontsize=9, frameon=False, title="state", title_fontsize=9
    )
    return fig


# ------------------------------------------------------------------------------------ (4) weights


def has_privacy(runs: list[RunData]) -> bool:
    return any(r.epsilon is not None for run in runs for r in run.rows)


def plot_privacy(runs: list[RunData]) -> Figure:
    """ε spent after each round, a line per run that ran under differential privacy."""
    fig = _new_figure(3.3)
    ax = fig.subplots(1, 1)
    for i, run in enumerate(runs):
        pts = [(r.round, r.epsilon) for r in run.rows if r.epsilon is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=run.label, **_run_style(i))
    ax.set_title("Privacy spent (client-level ε)", loc="left", fontsize=11)
    ax.set_ylabel("ε")
    ax.set_xlabel("round")
    _style(ax)
    ax.legend(fontsize=9, frameon=False)
    return fig


def has_weights(run: RunData) -> bool:
    return any(row.weights for row in run.rows)


def weight_grid(run: RunData) -> tuple[list[str], list[int], np.ndarray]:
    """(clients, rounds, grid[client, round]) of aggregation weights; NaN where a client had none."""
    clients = sorted({c for row in run.rows for c in row.weights}, key=run.clients().index)
    rounds = [row.round for row in run.rows]
    grid = np.full((len(clients), len(rounds)), np.nan)
    index = {c: i for i, c in enumerate(clients)}
    for j, row in enumerate(run.rows):
        for client, weight in row.weights.items():
            grid[index[client], j] = weight
    return clients, rounds, grid


def plot_weights(run: RunData) -> Figure:
    """Per-client aggregation weight (attention / JS / n_k share) per round as a heatmap;
    blank = no weight."""
    clients, rounds, grid = weight_grid(run)
    height = min(12.0, max(2.0, 0.28 * len(clients))) + 1.2
    fig = _new_figure(height)
    ax = fig.subplots()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#F2F2F2")
    finite = grid[np.isfinite(grid)]
    vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    image = ax.imshow(
        np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0.0, vmax=vmax
    )
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds], fontsize=8)
    if len(rounds) > 30:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20, min_n_ticks=1))
        ax.xaxis.set_major_formatter(lambda x, _pos: str(rounds[int(x)]) if 0 <= int(x) < len(rounds) else "")
    step = max(1, math.ceil(len(clients) / 40))
    ax.set_yticks(range(0, len(clients), step), clients[::step], fontsize=8)
    if len(rounds) <= 16 and len(clients) <= 16:
        for i in range(len(clients)):
            for j in range(len(rounds)):
                value = grid[i, j]
                if np.isfinite(value):
                    dark = value / vmax < 0.55  # viridis is dark at the low end
                    ax.text(
                        j,
                        i,
                        f"{value:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
    ax.set_xlabel("round")
    ax.set_ylabel("client")
    # the label names the run's strategy; the rounds' own are said only where they differ (a loss switch)
    strategies = list(dict.fromkeys(row.strategy for row in run.rows if row.strategy and row.weights))
    ax.set_title(
        f"Aggregation weight per client (attention / JS / n_k share; grey: none) — {run.label}"
        + (f", rounds using {', '.join(strategies)}" if strategies not in ([], [run.strategy]) else ""),
        loc="left",
        fontsize=11,
    )
    # the bar's label runs along the bar: short enough for the shortest figure
    bar = fig.colorbar(image, ax=ax, location="right", fraction=0.04, pad=0.01)
    bar.set_label("weight", fontsize=9)
    return fig
