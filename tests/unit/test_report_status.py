"""`fedmq status` views and the end-of-simulation summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.table import Table

from fedmq.cli.status import StatusError, render_status, render_summary, status_json, to_text
from fedmq.errors import FedmqError


def _row(rnd: int, **kw) -> dict:
    row = {
        "round": rnd,
        "strategy": "fedatt",
        "metric": "perplexity",
        "valid": 500.0 - 40 * rnd,
        "mean_loss": 6.0 - 0.2 * rnd,
        "online": ["agent-0", "agent-1", "agent-2", "agent-3"],
        "selected": ["agent-0", "agent-2"],
        "reported": ["agent-0", "agent-2"],
        "granted": ["agent-0", "agent-2"],
        "received": ["agent-0"],
        "dropped": ["agent-2"],
        "skipped": False,
        "bytes_up": 1_500_000,
        "bytes_down": 4_250_000,
        "wall_s": 12.25,
    }
    row.update(kw)
    return row


INFO = {
    "job": "wt2",
    "phase": "uploading",
    "round": 7,
    "version": 6,
    "aggregators": 2,
    "standby_waiting": True,
    "agents_online": ["agent-3", "agent-1", "agent-0"],
    "last_metrics": _row(6, dropped=["agent-2"], valid=260.5),
    "queue_depths": {"fedmq.wt2.inbox": 3, "fedmq.wt2.agent-0.global": 1, "fedmq.wt2.agent-1.control": 0},
    "broker": {"connected": True, "url": "amqp://127.0.0.1:5672/%2F", "version": "3.10.0"},
    "rejected": {"bad-digest": 2, "stale": 0},
    "presence_over_budget": {"wt2.host.h0": 4059},
}


def _lines_with(text: str, *words: str) -> list[str]:
    return [line for line in text.splitlines() if all(w in line for w in words)]


def test_render_status_shows_every_part() -> None:
    text = render_status(INFO)
    assert "fedmq status — job wt2" in text
    assert _lines_with(text, "phase", "uploading")
    assert _lines_with(text, "round", "7")
    assert _lines_with(text, "aggregators", "2 (a hot standby is waiting)")
    assert _lines_with(text, "agents online", "3: agent-0, agent-1, agent-3")
    assert _lines_with(text, "messages rejected", "bad-digest 2") and "stale 0" not in text
    assert _lines_with(text, "broker version", "3.10.0")
    assert _lines_with(text, "presence over budget", "wt2.host.h0 4059")
    assert "last round (6)" in text
    assert _lines_with(text, "validation perplexity", "260.50")
    assert _lines_with(text, "selected / reported / received", "2 / 2 / 1")
    assert _lines_with(text, "MB up / down", "1.50 / 4.25")
    assert _lines_with(text, "fedmq.wt2.inbox", "3")
    assert _lines_with(text, "fedmq.wt2.agent-1.control", "0")
    assert "\x1b[" not in text  # plain text unless color is asked for
    assert "\x1b[" in render_status(INFO, color=True)


def test_render_status_of_a_half_started_job() -> None:
    text = render_status({"job": "new"})
    assert "job new" in text and _lines_with(text, "phase", "—") and "last round" not in text
    assert "queue depths" not in text and "presence over budget" not in text
    many = render_status({"job": "big", "agents_online": [f"a{i:03d}" for i in range(30)]}, width=200)
    assert _lines_with(many, "agents online", "30: a000", "a011, … (+18)") and "a012" not in many


def test_status_json_is_strict_and_complete() -> None:
    info = {
        **INFO,
        "agents_online": {"b", "a"},
        "run_dir": Path("/tmp/run"),
        "last_metrics": _row(6, valid=math.inf, mean_loss=math.nan),
    }
    text = status_json(info)
    assert "\n" not in text
    back = json.loads(text)
    assert back["agents_online"] == ["a", "b"] and back["run_dir"] == "/tmp/run"
    assert back["last_metrics"]["valid"] is None and back["last_metrics"]["mean_loss"] is None
    assert back["queue_depths"] == INFO["queue_depths"] and back["standby_waiting"] is True
    assert json.loads(status_json(INFO)) == json.loads(json.dumps(INFO))


@pytest.mark.parametrize("bad", [None, [], "wt2", 3])
def test_status_rejects_non_mappings(bad) -> None:
    for fn in (render_status, status_json):
        with pytest.raises(StatusError, match=r"^status info must be a mapping, not \w+$") as info:
            fn(bad)
        assert isinstance(info.value, FedmqError)


SUMMARY = {
    "metric": "perplexity",
    "higher_is_better": False,
    "best_round": 4,
    "best_valid": 340.0,
    "test": 352.25,
    "rounds_completed": 4,
    "rounds_skipped": 1,
    "wall_s": 80.3,
    "strategy": "fedatt",
    "bytes_up": 7_500_000,
    "bytes_down": 21_250_000,
}


def test_render_summary_table() -> None:
    rows = [_row(r) for r in range(1, 6)]
    rows[2] = _row(3, skipped=True, valid=None, received=[], skip_reason="nobody online")
    table = render_summary(SUMMARY, rows)
    assert isinstance(table, Table)
    assert [c.header for c in table.columns][:3] == ["round", "strategy", "valid ppl"]
    assert table.row_count == 5
    narrow = to_text(table, width=80)
    assert "…" not in narrow and "valid ppl" in narrow  # fits an 80-column terminal uncut
    text = to_text(table, width=140)
    line4 = _lines_with(text, " 4 ", "fedatt", "340.00")[0]
    cells = line4.split()
    assert cells == ["4", "fedatt", "340.00", "5.200", "4", "2", "1", "1", "1.50", "4.25", "12.2"]
    assert _lines_with(text, " 3 ", "skipped")
    caption = " ".join(text.split())  # the caption may wrap
    assert "best valid perplexity 340.00 (round 4)" in caption and "test perplexity 352.25" in caption
    assert "4 rounds completed, 1 skipped" in caption and "7.50 MB up, 21.25 MB down" in caption
    assert "80.3 s" in caption


@pytest.mark.parametrize(
    "strategy", ["bring_your_own:UniformMean", "some.package.module:AVeryLongStrategyName"]
)
def test_a_long_strategy_name_gives_way_and_the_numbers_stay_whole_at_80_columns(strategy) -> None:
    """The README's bring-your-own command: at 80 columns every number of the final table stays whole (the
    strategy column shows the class and wraps; the title names it in full)."""
    rows = [
        _row(r, strategy=strategy, metric="accuracy", valid=0.8 + r / 100, mean_loss=0.41234) for r in (1, 2)
    ]
    text = to_text(render_summary({**SUMMARY, "metric": "accuracy", "strategy": strategy}, rows), width=80)
    assert "…" not in text and strategy in text.splitlines()[0]
    for cells in (["0.81", "0.412", "4", "2", "1", "1", "1.50", "4.25", "12.2"], ["0.82", "0.412"]):
        assert _lines_with(text, *cells), text
    assert _lines_with(text, strategy.rpartition(":")[2][:12], "0.81")  # the class, wrapped if need be


def test_render_summary_elides_long_runs_and_handles_no_summary_fields() -> None:
    rows = [_row(r) for r in range(1, 101)]
    table = render_summary({}, rows, max_rows=10)
    assert table.row_count == 10
    text = to_text(table, width=140)
    assert _lines_with(text, "…", "91 more")
    assert _lines_with(text, " 1 ", "fedatt") and _lines_with(text, " 100 ", "fedatt")
    assert not _lines_with(text, " 50 ", "fedatt")
    assert "best valid perplexity — (round —)" in " ".join(text.split())


def test_render_summary_rejects_bad_input() -> None:
    with pytest.raises(StatusError, match=r"^run summary must be a mapping, not list$"):
        render_summary([], [])
    with pytest.raises(StatusError, match=r"^metrics row must be a mapping, not str$"):
        render_summary(SUMMARY, ["round 1"])
