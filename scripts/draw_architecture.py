"""Draw docs/architecture.png: fedmq's layers (left) and one synchronous round's messages (right).

.venv/bin/python scripts/draw_architecture.py [OUT.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

BLUE, ORANGE, GREEN, GREY, PURPLE = "#0072B2", "#E69F00", "#009E73", "#999999", "#CC79A7"


def box(ax, x, y, w, h, title, body, color):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.01,rounding_size=0.015",
            fc=color,
            ec="black",
            alpha=0.18,
            lw=1,
        )
    )
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.015", fc="none", ec="black", lw=1
        )
    )
    if h < 0.09:  # a one-line layer: its name, then its body, inside the box
        ax.text(x + w / 2, y + h, title, ha="center", va="top", fontsize=10, fontweight="bold")
        ax.text(x + w / 2, y, body, ha="center", va="bottom", fontsize=7.5)
        return
    ax.text(x + w / 2, y + h - 0.025, title, ha="center", va="top", fontsize=10, fontweight="bold")
    ax.text(x + w / 2, y + h - 0.065, body, ha="center", va="top", fontsize=7.5, linespacing=1.35)


def layers(ax):
    ax.set_title(
        "Layers: each imports only those below it (aggregator and client_agent: never each other)",
        fontsize=10,
    )
    box(
        ax,
        0.03,
        0.895,
        0.94,
        0.075,
        "fedmq.cli",
        "app.py assembles commands/: simulate, aggregator, agent, broker, status, report, bench, experiment",
        GREY,
    )
    box(
        ax,
        0.03,
        0.80,
        0.94,
        0.065,
        "fedmq.benchmarks",
        "fedmq bench … (a module each), fedmq experiment … (experiments/: grids, runner, results)",
        GREY,
    )
    box(
        ax,
        0.03,
        0.705,
        0.94,
        0.065,
        "fedmq.simulation",
        "Simulation: an aggregator and K agents in one process, over a broker",
        GREY,
    )
    box(
        ax,
        0.03,
        0.45,
        0.44,
        0.2,
        "aggregator",
        "engine, presence, model stream,\nsync round, async rounds, inbox, spool,\n"
        "mediator, guards, strategies (each owns\nits round and state; DP wraps averaging ones),\n"
        "checkpoints, run log",
        BLUE,
    )
    box(
        ax,
        0.53,
        0.45,
        0.44,
        0.2,
        "client_agent",
        "one-client agent, host (many clients),\n"
        "joining a job, trainer pool,\nstate store, availability and faults",
        ORANGE,
    )
    box(
        ax,
        0.03,
        0.23,
        0.94,
        0.20,
        "broker",
        "transport: Broker interface, Subscription, in-process backend, RabbitMQ backend (one class owning\n"
        "its I/O thread, publisher, consumers, dispatcher), reassembly, topology, provisioning, TLS, URLs\n"
        "wire (below it): envelope, encodings, chunk frames, protocol messages (typed RoundConfig)",
        GREEN,
    )
    box(
        ax,
        0.03,
        0.01,
        0.94,
        0.19,
        "fedmq  (import fedmq: the public API)",
        "errors, checks, tensor manifest, tasks (models, data, local training),\n"
        "pulling rule, client hooks, plugins (package.module:Class), differential privacy (accountant,\n"
        "clipping, noise), secure aggregation's cryptographic core; imports nothing above",
        PURPLE,
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")


def round_flow(ax):
    ax.set_title("One synchronous round over RabbitMQ", fontsize=11)
    cols = {"aggregator": 0.12, "RabbitMQ": 0.5, "agent": 0.88}
    for name, x in cols.items():
        ax.text(
            x,
            0.97,
            name,
            ha="center",
            va="center",
            fontsize=10,
            fontweight="bold",
            bbox=dict(boxstyle="round", fc="white", ec="black"),
        )
        ax.plot([x, x], [0.02, 0.94], color="black", lw=0.8, ls=":")
    steps = [
        ("agent", "aggregator", "PRESENCE every heartbeat → inbox (quorum queue)"),
        ("aggregator", "aggregator", "select m of the online agents (seeded)"),
        ("aggregator", "RabbitMQ", "global model vN, once → model stream"),
        ("aggregator", "agent", "ANNOUNCE to each selected agent (round, vN, config) → its latest queue"),
        ("RabbitMQ", "agent", "fetch vN from the stream (a delta or the full model)"),
        ("agent", "agent", "train on the private shard (task.train)"),
        ("agent", "aggregator", "REPORT loss → inbox"),
        ("aggregator", "agent", "GRANT (grant phase: FedMed top-K, β < 1) → control queue"),
        ("agent", "aggregator", "UPDATE: encoded delta, chunked, confirmed → inbox"),
        ("aggregator", "aggregator", "spool to disk, ack, fold (strategy.fold), finish"),
        ("aggregator", "aggregator", "evaluate, checkpoint, next round: v(N+1)"),
    ]
    y = 0.90
    for src, dst, label in steps:
        y -= 0.078
        x0, x1 = cols[src], cols[dst]
        if src == dst:
            ax.text(
                x0 + (0.03 if x0 < 0.5 else -0.03),
                y,
                label,
                ha="left" if x0 < 0.5 else "right",
                va="center",
                fontsize=7.5,
                bbox=dict(boxstyle="round", fc="#f4f4f4", ec="none"),
            )
            continue
        ax.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops=dict(arrowstyle="->", lw=1.1))
        ax.text((x0 + x1) / 2, y + 0.018, label, ha="center", va="bottom", fontsize=7.5)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")


def main(out: Path) -> None:
    fig = Figure(figsize=(15, 6.2), dpi=110)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.25]})
    layers(left)
    round_flow(right)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parents[1] / "docs" / "architecture.png"
    )
