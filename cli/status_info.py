"""Collect what `fedmq status` shows: the broker's view (queues, consumers) and the run folder's (rounds, metrics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aggregator.runlog import read_jsonl
from broker import provision


def _last_row(run_dir: Path) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return rows[-1] if rows else {}


def gather(broker_url: str, job: str, run_dir: Path | None) -> dict[str, Any]:
    """A status dict for cli.status.render_status; raises BrokerError (one line) if the broker is unreachable."""
    checked = provision.check(broker_url, job)
    info: dict[str, Any] = {"job": job, "broker": {k: v for k, v in checked.items() if k != "queues"}}
    queues = checked.get("queues", {}) or {}
    info["queue_depths"] = {name: q.get("messages", q) if isinstance(q, dict) else q for name, q in queues.items()}
    inbox = queues.get(f"fedmq.{job}.inbox")
    consumers = inbox.get("consumers", 0) if isinstance(inbox, dict) else 0
    info["standby_waiting"] = consumers > 1
    info["aggregators"] = consumers
    row = _last_row(run_dir) if run_dir else {}
    info["last_metrics"] = row
    info["round"] = row.get("round")
    info["agents_online"] = row.get("online", [])
    if run_dir and (run_dir / "summary.json").is_file():
        info["phase"] = "finished"
    return info
