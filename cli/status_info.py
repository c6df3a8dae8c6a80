"""Collect what `fedmq status` shows: the broker's view (queues, consumers) and the run folder's (the live
status the active aggregator keeps in status.json, the last metrics row)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedmq.aggregator.runlog import finished, read_rounds, read_status
from fedmq.broker.transport import provision
from fedmq.errors import FedmqError

# the active aggregator rewrites status.json at least on every phase change and presence heartbeat; a live one
# older than this with nobody consuming the inbox is a dead aggregator's last word
STALE_S = 120.0


class UnknownJob(FedmqError):
    """Neither the broker nor the run folder knows the job: one line, exit code 1."""

    exit_code = 1


def gather(broker_url: str, job: str, run_dir: Path | None) -> dict[str, Any]:
    """A status dict for cli.status.render_status; BrokerError (one line) if the broker is unreachable,
    UnknownJob if the job has no inbox on the broker and no run in ``run_dir``."""
    checked = provision.check(broker_url, job)
    info: dict[str, Any] = {"job": job, "broker": {k: v for k, v in checked.items() if k != "queues"}}
    queues = checked.get("queues", {}) or {}
    inbox = queues.get(f"fedmq.{job}.inbox")
    on_broker = isinstance(inbox, dict) and not inbox.get("missing")
    info["queue_depths"] = {
        name: q.get("messages", q) if isinstance(q, dict) else q
        for name, q in queues.items()
        if not (isinstance(q, dict) and q.get("missing"))
    }
    consumers = inbox.get("consumers", 0) if on_broker else 0
    info["standby_waiting"] = consumers > 1
    info["aggregators"] = consumers
    live = read_status(run_dir) if run_dir else {}
    records = read_rounds(run_dir).records if run_dir else ()
    if not on_broker and not live and not records:
        where = (
            f" and no run in {run_dir}"
            if run_dir
            else " (a finished simulation deletes its queues: --run-dir reads its run folder)"
        )
        raise UnknownJob(
            f"no job {job!r} in vhost {_vhost(broker_url)!r} on {info['broker'].get('url', broker_url)}: "
            f"it has no inbox queue{where}{_other_vhost_hint(broker_url)}"
        )
    row = records[-1].to_json() if records else {}
    info["last_metrics"] = row
    info["round"] = row.get("round")
    if live.get("job") == job:
        for key in (
            "phase",
            "round",
            "version",
            "agents_online",
            "agents_online_count",
            "rejected",
            "dropped",
            "presence_over_budget",
            "epsilon",  # under differential privacy: ε spent so far and its δ
            "delta",
        ):
            if key in live:
                info[key] = live[key]
    if "delta" not in info and row.get("delta") is not None:  # no live status: the last round's ε
        info["epsilon"], info["delta"] = row.get("epsilon"), row["delta"]
        age = time.time() - float(live.get("updated_at", 0) or 0)
        if info.get("phase") not in ("finished", "stopped") and age > STALE_S and consumers == 0:
            info["phase"] = f"not running (last seen {age:,.0f} s ago, {live.get('phase')})"
            info["agents_online"] = []
    if run_dir and info.get("phase") != "stopped" and finished(run_dir):
        info["phase"] = "finished"
    if info.get("phase") == "finished":
        info["round"] = row.get("round")  # the last round, not the one the engine would have opened next
    if info.get("phase") in ("finished", "stopped") or str(info.get("phase", "")).startswith("not running"):
        info["agents_online"] = []  # nobody tracks presence once the aggregator is gone
    if not info.get("agents_online"):
        info.pop("agents_online_count", None)
    info.setdefault("agents_online", row.get("online", []) if row else [])
    return info


def _vhost(url: str) -> str:
    """The virtual host a broker URL names ('/' when it names none)."""
    from urllib.parse import unquote, urlsplit

    from fedmq.broker.transport.urls import addresses

    if url.startswith("memory://"):
        return "/"
    path = urlsplit(addresses(url)[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def _other_vhost_hint(url: str) -> str:
    """Where else to look: a provisioned job lives in its own vhost (`fedmq broker provision --vhost`)."""
    if url.startswith("memory://") or _vhost(url) != "/":
        return ""
    return (
        "; a job provisioned in another vhost is seen with --broker amqp://USER:PASS@HOST:PORT/VHOST "
        "(e.g. its aggregator's URL from the credentials file)"
    )
