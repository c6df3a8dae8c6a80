"""`fedmq report`: figures, HTML, markdown scores and errors, on synthetic but realistic run folders."""

from __future__ import annotations

import base64
import io
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fedmq.aggregator.records import RoundRecord
from fedmq.cli.plots import DROPPED, OFFLINE, ONLINE, REPORTED, UPLOADED, client_state, participation_grid
from fedmq.cli.report import build_report, markdown_table, run_report, score_of
from fedmq.cli.runs import ReportError, load_run
from fedmq.errors import FedmqError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODEL_RAW = 4 * 250_000  # fp32 bytes of a 250k-parameter model


def write_run_dir(
    root: Path,
    name: str,
    *,
    strategy: str = "fedatt",
    clients: int = 10,
    rounds: int = 6,
    fraction: float = 0.5,
    top_k: float = 1.0,
    seed: int = 0,
    complete: bool = True,
    metric: str = "perplexity",
    encoding: str = "bf16",
    garbage: list[str] = (),
    decay: float = 0.8,
) -> Path:
    """Write a run folder the way the aggregator does: config.json, metrics.jsonl and
    (if complete) summary.json.

    Clients come and go (15 % offline per round), some selected clients drop, FedMed-like runs grant only
    the top-K reporters and fall back to FedAvg when the loss barely moves. ``garbage`` lines are appended
    to metrics.jsonl after the valid rows.
    """
    rng = random.Random(seed)
    run = root / name
    run.mkdir(parents=True)
    agents = [f"agent-{i}" for i in range(clients)]
    config = {
        "task": "lm" if metric == "perplexity" else "mt",
        "data": "ptb",
        "model": "gru-small",
        "strategy": strategy,
        "clients": clients,
        "fraction": fraction,
        "rounds": rounds,
        "encoding": encoding,
        "seed": seed,
        "job": f"job-{name}",
        "epsilon": 1.2,
        "top_k": top_k,
    }
    (run / "config.json").write_text(json.dumps(config))
    ratio = {"bf16": 2.0, "fp32": 1.0, "int8": 3.9}[encoding]
    rows: list[dict[str, Any]] = []
    valid = 900.0 if metric == "perplexity" else 4.0
    loss_prev = None
    for rnd in range(1, rounds + 1):
        online = [a for a in agents if rng.random() > 0.15]
        selected = sorted(
            rng.sample(online, max(1, int(fraction * clients))) if len(online) else [], key=agents.index
        )
        reported = [a for a in selected if rng.random() > 0.12]
        # top-K grants; without a grant phase (top_k = 1) the engine logs granted = selected
        granted = reported[: max(1, math.ceil(top_k * len(reported)))] if top_k < 1 else list(selected)
        received = [a for a in granted if a in reported and rng.random() > 0.1]
        dropped = [a for a in selected if a not in received]  # as the engine logs it: selected - received
        mean_loss = 6.8 - 0.35 * rnd + rng.uniform(-0.05, 0.05)
        applied = strategy
        if strategy == "fedmed" and loss_prev is not None and abs(mean_loss - loss_prev) < 0.34:
            applied = "fedavg"
        loss_prev = mean_loss
        skipped = not received
        if not skipped:
            valid = valid * decay + rng.uniform(-5, 5) if metric == "perplexity" else valid + 2.1
        raw_w = {a: rng.uniform(0.5, 1.5) for a in received}
        total = sum(raw_w.values())
        rows.append(
            {
                "round": rnd,
                "time": 1763700000.0 + 12.5 * rnd,
                "strategy": applied,
                "metric": metric,
                "valid": None if skipped or rnd == 2 else round(valid, 3),
                "mean_loss": round(mean_loss, 4),
                "online": online,
                "selected": selected,
                "reported": reported,
                "granted": granted,
                "received": received,
                "dropped": dropped,
                "skipped": skipped,
                "bytes_up": int(len(received) * MODEL_RAW / ratio),
                "bytes_down": int(len(online) * MODEL_RAW / ratio),
                "bytes_up_raw": len(received) * MODEL_RAW,
                "bytes_down_raw": len(online) * MODEL_RAW,
                "wall_s": 12.5,
                "weights": {a: round(w / total, 4) for a, w in raw_w.items()},
                "rejected": {"stale": rnd % 2, "bad-digest": 0},
            }
        )
    lines = [json.dumps(r) for r in rows] + list(garbage)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if complete:
        higher = metric != "perplexity"
        evaluated = [(r["round"], r["valid"]) for r in rows if r["valid"] is not None]
        best_round, best_valid = (max if higher else min)(evaluated, key=lambda rv: rv[1])
        summary = {
            "metric": metric,
            "higher_is_better": higher,
            "best_round": best_round,
            "best_valid": best_valid,
            "test": round(best_valid * (1.03 if not higher else 0.97), 3),
            "rounds_completed": sum(not r["skipped"] for r in rows),
            "rounds_skipped": sum(r["skipped"] for r in rows),
            "wall_s": 12.5 * rounds,
            "strategy": strategy,
            "bytes_up": sum(r["bytes_up"] for r in rows),
            "bytes_down": sum(r["bytes_down"] for r in rows),
        }
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def _assert_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5_000, f"{path} is suspiciously small ({len(data)} bytes)"
    with Image.open(io.BytesIO(data)) as img:
        img.verify()  # checks the chunk CRCs
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        assert img.format == "PNG"
        assert img.width >= 600 and img.height >= 200
        colours = img.convert("RGB").getcolors(maxcolors=1_000_000)
        assert colours is None or len(colours) > 8, f"{path} looks blank"
        return img.size


def _read_rows(run: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.startswith("{") and line.endswith("}")
    ]


# ------------------------------------------------------------------------------------------- outputs


def test_single_run_writes_valid_pngs_html_and_markdown(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "ptb-fedatt", strategy="fedatt")
    out = tmp_path / "out"
    result = build_report([run], out)

    assert set(result.figures) == {"validation", "bytes", "participation-ptb-fedatt", "weights-ptb-fedatt"}
    for path in result.figures.values():
        assert path.parent == out
        _assert_png(path)
    html = result.html.read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html
    assert not re.search(r"""<(link|img)[^>]+(href|src)="(?!data:)[^"]+\.(css|js|png)""", html)
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(embedded) == len(result.figures)
    for key, path in result.figures.items():
        assert f'id="fig-{key}"' in html
        assert f'href="{path.name}"' in html  # the file beside the page is linked too
        assert base64.b64decode(embedded[list(result.figures).index(key)]) == path.read_bytes()
    md = result.markdown.read_text()
    table = markdown_table(result.scores)
    assert table in md
    for line in table.splitlines():  # the same scores appear in the HTML table
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "ptb-fedatt":
            assert all("<td" in html and f">{c}</td>" in html for c in cells)
    assert "gru-small" in html and "<caption>ptb-fedatt</caption>" in html  # config summary
    assert result.describe().startswith(f"report written to {result.html}")


def test_markdown_scores_match_summary(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "a", strategy="fedatt", rounds=7, seed=3)
    summary = json.loads((run / "summary.json").read_text())
    rows = _read_rows(run)
    result = build_report([run], tmp_path / "out")
    md = result.markdown.read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| a |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    final = [r["valid"] for r in rows if r["valid"] is not None][-1]
    assert cells[:3] == ["a", "fedatt", "perplexity"]
    assert cells[3] == f"{summary['best_valid']:,.2f} ({summary['best_round']})"
    assert cells[4] == f"{final:,.2f}"
    assert cells[5] == f"{summary['test']:,.2f}"
    assert cells[6] == f"{summary['rounds_completed']}/7"
    assert cells[7] == str(summary["rounds_skipped"])
    assert cells[8] == f"{summary['bytes_up'] / 1e6:,.2f}"
    assert cells[9] == f"{summary['bytes_down'] / 1e6:,.2f}"
    assert cells[10] == "87.5" and cells[11] == "complete"


def test_several_runs_side_by_side(tmp_path: Path) -> None:
    runs = [
        write_run_dir(tmp_path, "fedatt", strategy="fedatt", seed=1),
        write_run_dir(tmp_path, "fedmed", strategy="fedmed", top_k=0.5, seed=2),
        write_run_dir(tmp_path, "fedavg", strategy="fedavg", seed=4, encoding="fp32"),
    ]
    result = build_report(runs, tmp_path / "cmp")
    assert [s.run for s in result.scores] == ["fedatt", "fedmed", "fedavg"]
    assert {f"participation-{n}" for n in ("fedatt", "fedmed", "fedavg")} <= set(result.figures)
    for path in result.figures.values():
        _assert_png(path)
    # one validation figure with every run: taller than wide is not needed, but it must hold 3 legends
    html = result.html.read_text()
    for name in ("fedatt", "fedmed", "fedavg"):
        assert f"<caption>{name}</caption>" in html
    fedmed = load_run(runs[1])
    assert {"fedmed", "fedavg"} == {r.strategy for r in fedmed.rows}  # the loss switch is visible


def test_bleu_and_perplexity_runs_get_separate_panels(tmp_path: Path) -> None:
    lm = write_run_dir(tmp_path, "lm", metric="perplexity")
    mt = write_run_dir(tmp_path, "mt", metric="bleu", strategy="dp-local")
    result = build_report([lm, mt], tmp_path / "out")
    scores = {s.run: s for s in result.scores}
    assert scores["mt"].metric == "bleu"
    # BLEU is higher-is-better: best = max over the evaluated rounds
    rows = _read_rows(mt)
    assert scores["mt"].best_valid == pytest.approx(max(r["valid"] for r in rows if r["valid"] is not None))
    w, h = _assert_png(result.figures["validation"])
    w1, h1 = _assert_png(build_report([lm], tmp_path / "one").figures["validation"])
    assert h > h1  # a second metric panel was added


def test_incomplete_run_is_reported_as_such(tmp_path: Path) -> None:
    run = write_run_dir(
        tmp_path, "killed", complete=False, rounds=4, garbage=['{"round": 5, "time": 17637000']
    )  # torn last line of a killed run
    result = build_report([run], tmp_path / "out")
    score = result.scores[0]
    rows = _read_rows(run)
    evaluated = [(r["round"], r["valid"]) for r in rows if r["valid"] is not None]
    best = min(evaluated, key=lambda rv: rv[1])
    assert not score.complete and score.test is None
    assert (score.best_round, score.best_valid) == best
    assert score.bytes_up == sum(r["bytes_up"] for r in rows)
    md = result.markdown.read_text()
    assert "incomplete" in md and "no summary.json" in md and "up to round 4" in md
    assert "skipped 1 malformed line(s)" in md
    assert result.malformed_lines == {"killed": 1}
    assert "no summary.json" in result.html.read_text()


def test_malformed_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    garbage = [
        "not json",
        "[1, 2]",
        '{"round": "three"}',
        '{"round": 9, "online": "agent-0"}',
        '{"round": 10, "valid": "low"}',
        '{"round": -1}',
        '{"round": true}',
        '{"no_round": 1}',
        '{"round": 11, "weights": {"agent-0": "x"}}',
        "\x00\x01\x02",
    ]
    run = write_run_dir(tmp_path, "noisy", rounds=5, garbage=garbage)
    loaded = load_run(run)
    assert loaded.malformed_lines == len(garbage)
    assert [r.round for r in loaded.rows] == [1, 2, 3, 4, 5]
    result = build_report([run], tmp_path / "out")
    assert result.malformed_lines == {"noisy": len(garbage)}
    assert f"skipped {len(garbage)} malformed line(s)" in result.markdown.read_text()
    assert "skipped 10 malformed" in result.describe()


def test_duplicate_rounds_keep_the_last_entry(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "resumed", rounds=3)
    rows = _read_rows(run)
    again = dict(rows[1], valid=123.0)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(again) + "\n")
    loaded = load_run(run)
    assert loaded.duplicate_rounds == 1 and loaded.rows[1].valid == 123.0
    assert [r.round for r in loaded.rows] == [1, 2, 3]


def test_missing_optional_fields_and_no_weights(tmp_path: Path) -> None:
    run = tmp_path / "minimal"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"round": r, "valid": 500.0 - 50 * r, "online": ["a", "b"], "received": ["a"]})
            for r in range(1, 4)
        )
    )
    result = build_report([run], tmp_path / "out")
    assert set(result.figures) == {"validation", "bytes", "participation-minimal"}  # no weights -> no heatmap
    for path in result.figures.values():
        _assert_png(path)
    score = result.scores[0]
    assert score.best_valid == 350.0 and score.best_round == 3 and score.bytes_up is None
    assert "no config.json" in result.markdown.read_text()


def test_default_output_folder(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "r", rounds=2)
    result = run_report([str(run)])
    assert result.out_dir == run / "report" and result.html.is_file()


# ------------------------------------------------------------------------------------------- participation


def test_client_state_precedence() -> None:
    # b selected, silent; c reported but not granted; d uploaded; e granted, never uploaded; f logged dropped
    row = RoundRecord(
        1,
        online=tuple("abcdef"),
        selected=tuple("bcdef"),
        reported=tuple("cde"),
        granted=tuple("de"),
        received=("d",),
        dropped=tuple("bcef"),
    )
    assert [client_state(row, c) for c in "abcdefg"] == [
        ONLINE,
        DROPPED,
        REPORTED,
        UPLOADED,
        DROPPED,
        DROPPED,
        OFFLINE,
    ]


def test_participation_grid_counts_match_rows(tmp_path: Path) -> None:
    run = load_run(write_run_dir(tmp_path, "grid", rounds=6, seed=7))
    clients, rounds, grid = participation_grid(run)
    assert clients == [f"agent-{i}" for i in range(10)] or clients == sorted(
        clients, key=lambda c: int(c[6:])
    )
    for j, row in enumerate(run.rows):
        assert (grid[:, j] == UPLOADED).sum() == len(row.received)
        assert (grid[:, j] != OFFLINE).sum() == len(row.online)


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "run folder not found: {p}"),
        ("file", "not a fedmq run folder: {p} is not a folder"),
        ("empty", "not a fedmq run folder: {p} has no metrics.jsonl"),
        ("bad-config", "{p}/config.json is not valid JSON (line 1: Expecting value)"),
        ("list-summary", "{p}/summary.json must hold a JSON object, not list"),
        ("all-garbage", "{p}/metrics.jsonl has no valid round rows yet (2 malformed line(s))"),
        ("no-rows", "{p}/metrics.jsonl has no valid round rows yet"),
    ],
)
def test_bad_run_folders_raise_one_clear_line(tmp_path: Path, case: str, message: str) -> None:
    p = tmp_path / case
    if case == "file":
        p.write_text("x")
    elif case != "missing":
        p.mkdir()
    if case == "bad-config":
        (p / "metrics.jsonl").write_text('{"round": 1}\n')
        (p / "config.json").write_text("nope")
    if case == "list-summary":
        (p / "metrics.jsonl").write_text('{"round": 1}\n')
        (p / "summary.json").write_text("[]")
    if case == "all-garbage":
        (p / "metrics.jsonl").write_text("oops\n{\n")
    if case == "no-rows":
        (p / "metrics.jsonl").write_text("\n")
    good = write_run_dir(tmp_path, "good", rounds=2)
    out = tmp_path / "out"
    with pytest.raises(ReportError) as info:
        build_report([good, p], out)
    assert isinstance(info.value, FedmqError)
    assert str(info.value) == message.format(p=p)
    assert "\n" not in str(info.value)
    assert not out.exists()  # nothing was written


def test_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "r", rounds=2)
    target = tmp_path / "taken"
    target.write_text("keep me")
    with pytest.raises(ReportError, match=r"^report output .*taken exists and is not a folder$"):
        build_report([run], target)
    assert target.read_text() == "keep me"


def test_no_run_folder_given() -> None:
    with pytest.raises(ReportError, match="^no run folder given$"):
        build_report([], Path("unused"))


def test_same_folder_name_twice_gets_distinct_labels(tmp_path: Path) -> None:
    a = write_run_dir(tmp_path / "x", "run")
    b = write_run_dir(tmp_path / "y", "run", strategy="fedavg")
    result = build_report([a, b, a], tmp_path / "out")
    assert [s.run for s in result.scores] == ["x/run", "y/run", "x/run#2"]
    assert len(set(result.figures)) == len(result.figures) == 2 + 3 + 3


def test_score_of_uses_rows_when_summary_lacks_fields(tmp_path: Path) -> None:
    run = write_run_dir(tmp_path, "partial", rounds=3)
    (run / "summary.json").write_text(json.dumps({"metric": "perplexity", "test": 1.5}))
    score = score_of(load_run(run))
    rows = _read_rows(run)
    assert score.test == 1.5 and score.complete
    assert score.best_valid == min(r["valid"] for r in rows if r["valid"] is not None)


def test_single_round_run_has_integer_round_ticks(tmp_path: Path) -> None:
    from fedmq.cli.plots import plot_bytes, plot_participation, plot_validation

    run = load_run(write_run_dir(tmp_path, "one", rounds=1, complete=False))
    for fig in (plot_validation([run]), plot_bytes([run]), plot_participation(run)):
        fig.canvas.draw()
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert all(float(t).is_integer() for t in ticks), ticks


def _legend_texts(fig: Any) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_legends_name_each_run_and_strategy_once(tmp_path: Path) -> None:
    """A run that applied one strategy is named with it once (its label); markers for the strategy applied
    are explained only where a run switched strategy (FedMed's fallback to FedAvg)."""
    from fedmq.cli.plots import plot_bytes, plot_participation, plot_validation

    runs = [
        load_run(write_run_dir(tmp_path, "a", strategy="fedavg", seed=1)),
        load_run(write_run_dir(tmp_path, "b", strategy="fedatt", seed=2)),
    ]
    for fig in (plot_validation(runs), plot_bytes(runs), plot_participation(runs[0])):
        texts = _legend_texts(fig)
        assert len(texts) == len(set(texts)), texts
    texts = _legend_texts(plot_validation(runs))
    for strategy in ("fedavg", "fedatt"):
        assert sum(strategy in t for t in texts) == 1, texts
    switched = load_run(write_run_dir(tmp_path, "m", strategy="fedmed", top_k=0.5, seed=2))
    assert {r.strategy for r in switched.rows} == {"fedmed", "fedavg"}
    texts = _legend_texts(plot_validation([switched]))
    assert "round used fedmed" in texts and "round used fedavg" in texts and len(texts) == len(set(texts))


def test_equal_byte_series_stay_visible(tmp_path: Path) -> None:
    """Raw fp32 up and down are often the same bytes: the line drawn second must not hide the first."""
    from matplotlib.lines import Line2D

    from fedmq.cli.plots import plot_bytes

    run = write_run_dir(tmp_path, "same", seed=3)
    rows = _read_rows(run)
    for row in rows:
        row["bytes_down_raw"] = row["bytes_up_raw"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot_bytes([load_run(run)])
    lines = [ln for ln in fig.axes[0].get_lines() if isinstance(ln, Line2D)]
    assert len(lines) == 4
    for i, first in enumerate(lines):
        for second in lines[i + 1 :]:
            if np.array_equal(first.get_xydata(), second.get_xydata()):
                # both seen: markers that differ and dashes that interleave
                assert first.get_marker() != second.get_marker()
                assert first.get_linestyle() == "-" or first._dash_pattern != second._dash_pattern


def test_weight_colour_bar_label_is_inside_the_figure(tmp_path: Path) -> None:
    from fedmq.cli.plots import plot_weights

    for clients in (3, 10):  # the shortest figure, and a taller one
        run = write_run_dir(tmp_path, f"w{clients}", clients=clients, rounds=3, complete=False)
        fig = plot_weights(load_run(run))
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        for ax in fig.axes:
            label = ax.yaxis.label
            if label.get_text():
                extent = label.get_window_extent(renderer)
                assert box.x0 <= extent.x0 and extent.x1 <= box.x1, (label.get_text(), extent, box)
                assert box.y0 <= extent.y0 and extent.y1 <= box.y1, (label.get_text(), extent, box)
