"""Draw the plots of docs/results/ that compare methods (table2, fraction, rounds-to-target, topk, privacy,
privacy-async) from the kept results files (benchmarks/results/*.json), not from run folders.

.venv/bin/python scripts/draw_results.py [NAME ...] [--out DIR]   (default: all, into docs/results/)

A method is named by the strategy its rows record (``label``): a FedMed run made with a variant of FedMed's
weights is called by that variant (``fedmed-relative``), as the pages call it; "FedMed" is the paper's
formula.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmq.benchmarks import results_file  # noqa: E402
from fedmq.benchmarks.experiments.results import mean_sd  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "results"

# the name a strategy recorded in a results row goes by in the pages and the plots
LABELS = {
    "fedsgd": "FedSGD",
    "fedavg": "FedAvg",
    "fedatt": "FedAtt",
    "fedmed": "FedMed",
    "fedmed-relative": "fedmed-relative",
    "fedmed-standardised": "fedmed-standardised",
    "central": "centralized",
}
COLORS = {
    "fedavg": "tab:blue",
    "fedatt": "tab:red",
    "fedmed": "tab:green",
    "fedmed-relative": "tab:green",
    "fedmed-standardised": "tab:olive",
    "central": "tab:gray",
    "fedsgd": "tab:purple",
}
SEEDS = (0, 1, 2)


def label(strategy: str) -> str:
    """The plots' name of ``strategy`` (a results row's ``strategy``): its page's name."""
    return LABELS[strategy]


def _mean_sd_line(ax: Any, xs: list[float], stats: list[tuple[float, float]], strategy: str) -> None:
    """One method's means with ± sd bars, in its colour and under its name."""
    ax.errorbar(
        xs,
        [m for m, _ in stats],
        yerr=[sd for _, sd in stats],
        color=COLORS[strategy],
        marker="o",
        markersize=4,
        capsize=3,
        label=label(strategy),
    )


def rows(
    files: Iterable[str], strategy: str, seeds: Iterable[int] | None = SEEDS, **where: Any
) -> list[dict[str, Any]]:
    """The rows of ``strategy`` whose labels match ``where``, one per seed (the first file that has it)."""
    found: dict[int, dict[str, Any]] = {}
    for name in files:
        for row in results_file.read(RESULTS / name)["runs"]:
            if row.get("strategy") != strategy or any(row.get(k) != v for k, v in where.items()):
                continue
            if (seeds is None or row["seed"] in seeds) and row.get("finished", True):
                found.setdefault(row["seed"], row)
    return [found[s] for s in sorted(found)]


def _stat(picked: list[dict[str, Any]], key: str = "test") -> tuple[float, float]:
    if not picked:
        raise SystemExit(f"no rows for a point of the plot ({key})")
    return mean_sd([r[key] for r in picked])


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _clean(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)


def table2() -> Figure:
    """Test perplexity by method at C = 0.1 and 0.5 (FedAvg, FedAtt, fedmed-relative, the centralized
    baseline), mean ± sd with each seed a dot; FedSGD (C = 1) in the title, far off the bars' scale."""
    files = ["table2.cpu.json", "table2.cpu.fedmed-relative.json"]
    fedsgd = rows(files, "fedsgd", seeds=None)
    sgd_m, sgd_sd = _stat(fedsgd)
    fig = _figure(7.5, 3.2)
    axes = fig.subplots(1, 2)
    shown = ("fedavg", "fedatt", "fedmed-relative", "central")
    for ax, c, chosen in zip(axes, (0.1, 0.5), (2, 10), strict=True):
        points = {s: rows(files, s, seeds=None, C=c) for s in shown}
        for x, s in enumerate(shown):
            vals = [r["test"] for r in points[s]]
            m, sd = _stat(points[s])
            ax.bar(x, m, color=COLORS[s], alpha=0.8, width=0.8)
            ax.errorbar(x, m, yerr=sd, color="black", capsize=3, linewidth=1.5)
            ax.plot([x] * len(vals), vals, ".", color="black", markersize=4)
        tops = [r["test"] for s in shown for r in points[s]]
        low = min(tops)
        ax.set_ylim(10 * int((low - 0.15 * (max(tops) - low)) // 10), None)
        ax.set_xticks(range(len(shown)), [label(s).replace("-", "-\n") for s in shown], fontsize=9)
        ax.set_title(f"C = {c} ({chosen} of 20 clients a round)", fontsize=11)
        ax.set_ylabel("test perplexity (lower is better)")
        _clean(ax)
    fig.suptitle(
        f"table2, cpu scale (PTB): mean ± sd, dots = seeds; "
        f"{label('fedsgd')} ({sgd_m:.0f} ± {sgd_sd:.0f}) off the scale",
        fontsize=10,
    )
    return fig


def fraction() -> Figure:
    """Test perplexity against the client fraction C, mean ± sd over seeds 0-2, one line a method."""
    files = ["fraction.cpu.json", "fraction.cpu.fedmed-relative.json", "table2.cpu.fedmed-relative.json"]
    cs = (0.1, 0.2, 0.5, 0.7, 0.9)
    fig = _figure(6.5, 3.2)
    ax = fig.subplots()
    for i, s in enumerate(("fedavg", "fedatt", "fedmed-relative")):
        stats = [_stat(rows(files, s, C=c)) for c in cs]
        _mean_sd_line(ax, [c + (i - 1) * 0.005 for c in cs], stats, s)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("client fraction C (of 20 clients)")
    ax.set_ylabel("test perplexity")
    ax.set_title("fraction, cpu scale (PTB): mean ± sd over 3 seeds", fontsize=10)
    ax.legend(frameon=False)
    _clean(ax)
    return fig


def rounds_to_target() -> Figure:
    """Validation perplexity by round (mean of seeds 0-2) at E = 1 and 2, with the target (FedAvg E = 1's
    best)."""
    files = [
        "rounds-to-target.cpu.json",
        "rounds-to-target.cpu.fedmed-relative.json",
        "table2.cpu.fedmed-relative.json",
    ]
    fig = _figure(6.5, 3.4)
    ax = fig.subplots()
    for e, style in ((1, "-"), (2, "--")):
        for s in ("fedavg", "fedatt", "fedmed-relative"):
            picked = rows(files, s, E=e, encoding="raw")
            if not picked and e == 1:  # E = 1 is table2's C = 0.5 cell, where its rows have no E
                picked = rows(files, s, C=0.5)
            curves = [r["valid_curve"] for r in picked]
            mean = [mean_sd(list(v))[0] for v in zip(*curves, strict=True)]
            ax.plot(
                range(1, len(mean) + 1),
                mean,
                style,
                color=COLORS[s],
                linewidth=1.6,
                label=f"{label(s)}, E = {e}",
            )
    target = mean_sd([r["target"] for r in rows(files, "fedavg", E=1, encoding="raw")])[0]
    ax.axhline(target, color="black", linestyle=":", linewidth=0.8)
    ax.text(12.1, target, "target", va="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(380, 3000)
    ticks = [400, 500, 700, 1000, 2000, 3000]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("round")
    ax.set_ylabel("validation perplexity (mean of 3 seeds)")
    ax.set_title("rounds-to-target, cpu scale (PTB, C = 0.5): target = FedAvg E = 1's best", fontsize=10)
    ax.legend(frameon=False, ncol=2, fontsize=8)
    _clean(ax)
    return fig


def topk() -> Figure:
    """Test perplexity (mean ± sd over seeds 0-2) and upload bytes against the top-K share β."""
    s = "fedmed-relative"
    betas = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0)
    picked = [
        rows(["topk.cpu.fedmed-relative.json"], s, beta=b)
        if b < 1
        else rows(["table2.cpu.fedmed-relative.json"], s, C=0.5)
        for b in betas
    ]
    fig = _figure(6.5, 3.2)
    ax = fig.subplots()
    bytes_ax = ax.twinx()
    upload_mb = [_stat(p, "bytes_up")[0] / 1e6 for p in picked]
    bytes_ax.bar(betas, upload_mb, width=0.04, color="lightgrey")
    bytes_ax.set_ylim(0, 2.2 * max(upload_mb))  # the bars in the lower half, under the curve
    bytes_ax.set_ylabel("upload MB a run (bars)")
    ax.set_zorder(bytes_ax.get_zorder() + 1)
    ax.patch.set_visible(False)
    stats = [_stat(p) for p in picked]
    _mean_sd_line(ax, betas, stats, s)
    ax.set_xlabel("top-K share β (uploads granted to the β·10 lowest-loss clients)")
    ax.set_ylabel("test perplexity", color=COLORS[s])
    ax.set_title(f"topk, cpu scale (PTB, C = 0.5, {label(s)}): mean ± sd over 3 seeds", fontsize=10)
    ax.spines[["top"]].set_visible(False)
    bytes_ax.spines[["top"]].set_visible(False)
    return fig


PRIVACY_FILE = "commands/privacy.k10000.json"  # made by command lines, not a grid
# (dp, target ε, S), colour, line style, name: the always-online runs of the privacy page
PRIVACY_LINES = (
    (("none", None, None), "tab:blue", "-", "no DP"),
    (("central", None, 0.56), "tab:gray", ":", "clipping alone, S = 0.56, z = 0"),
    (("central", 8.0, 0.56), "tab:orange", "-", "ε = 8, S = 0.56"),
    (("central", 2.0, 0.56), "tab:red", "--", "ε = 2, S = 0.56"),
    (("central", 8.0, 1.0), "tab:green", "-", "ε = 8, S = 1.0"),
    (("central", 2.0, 1.0), "tab:olive", "--", "ε = 2, S = 1.0"),
)


def _privacy_runs(always: bool) -> list[dict[str, Any]]:
    """The privacy page's runs with every client online (``always``), or with intermittent ones."""
    runs = results_file.read(RESULTS / PRIVACY_FILE)["runs"]
    return [r for r in runs if (r.get("availability", "always") == "always") == always]


def _log_ticks(ax: Any, ticks: list[int]) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(ticks, [str(t) for t in ticks])


def privacy() -> Figure:
    """Validation perplexity and ε against rounds, every client online: no DP, clipping alone, ε = 8 and
    ε = 2 at S = 0.56 and at S = 1.0 (each seed thin, their mean thick)."""
    fig = _figure(9.5, 3.4)
    ppl_ax, eps_ax = fig.subplots(1, 2, width_ratios=(3, 2))
    runs = _privacy_runs(always=True)
    for key, color, style, name in PRIVACY_LINES:
        picked = [r for r in runs if (r["dp"], r["target_epsilon"], r.get("clip_norm")) == key]
        if not picked:
            continue
        curves = [r["valid_curve"] for r in picked]
        for curve in curves:
            ppl_ax.plot(range(1, len(curve) + 1), curve, style, color=color, linewidth=0.6, alpha=0.5)
        mean = [mean_sd(list(v))[0] for v in zip(*curves, strict=True)]
        seeds = f"{len(picked)} seed{'s' if len(picked) > 1 else ''}"
        ppl_ax.plot(
            range(1, len(mean) + 1), mean, style, color=color, linewidth=1.8, label=f"{name} ({seeds})"
        )
        if key[1] is not None and key[2] == 0.56:  # S does not change ε
            eps = picked[0]["epsilon_curve"]
            eps_ax.plot(
                range(1, len(eps) + 1), eps, style, color=color, linewidth=1.8, label=f"ε = {key[1]:g}"
            )
            eps_ax.axhline(key[1], color=color, linestyle=":", linewidth=0.8)
    _log_ticks(ppl_ax, [500, 700, 1000, 2000, 5000, 10000])
    ppl_ax.set_xlabel("round")
    ppl_ax.set_ylabel("validation perplexity")
    ppl_ax.set_title("WikiText-2, K = 10,000, 100 a round (gru-tiny)", fontsize=10)
    ppl_ax.legend(frameon=False, fontsize=8)
    eps_ax.set_xlabel("round")
    eps_ax.set_ylabel("ε spent (δ = 1/K^1.1)")
    eps_ax.set_title("ε against rounds (RDP accountant)", fontsize=10)
    eps_ax.legend(frameon=False, fontsize=8)
    for ax in (ppl_ax, eps_ax):
        _clean(ax)
    return fig


def privacy_async() -> Figure:
    """Validation perplexity against wall time under DP (ε = 8), clients online half the time: sync and
    async, each seed's pair run side by side (one line style a seed)."""
    fig = _figure(6.5, 3.4)
    ax = fig.subplots()
    styles = ("-", "--", ":")
    for r in sorted(_privacy_runs(always=False), key=lambda r: (r["strategy"], r["seed"])):
        if r["strategy"] != "async":
            name, color = "sync (Poisson, q = 0.01)", "tab:orange"
        else:
            name, color = "async (buffer 100)", "tab:purple"
        ax.plot(
            r["time_curve"],
            r["valid_curve"],
            styles[r["seed"] % len(styles)],
            color=color,
            linewidth=1.3,
            label=f"{name}, z = {r['noise_multiplier']:.2f}, seed {r['seed']}",
        )
    _log_ticks(ax, [700, 1000, 2000, 5000, 10000])
    ax.set_xlabel("wall seconds from round 1's start (2-core VM)")
    ax.set_ylabel("validation perplexity")
    ax.set_title("DP (ε = 8), availability bernoulli 0.5: sync against async", fontsize=10)
    ax.legend(frameon=False, fontsize=7)
    _clean(ax)
    return fig


FIGURES = {
    "table2": table2,
    "fraction": fraction,
    "rounds-to-target": rounds_to_target,
    "topk": topk,
    "privacy": privacy,
    "privacy-async": privacy_async,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"{', '.join(FIGURES)} (default: all)")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    for name in args.names or list(FIGURES):
        if name not in FIGURES:
            parser.error(f"no plot {name!r}: {', '.join(FIGURES)}")
        path = args.out / f"{name}.png"
        FIGURES[name]().savefig(path, dpi=100)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
