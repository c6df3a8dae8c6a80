"""Prometheus metrics plus /healthz, /readyz and /status on one small HTTP server (Kubernetes probes).

Counters that grow with rounds are observed from the engine's per-round rows (``observe_round``); everything
else is read from the service's live ``status()`` at scrape time, so there is no second source of truth.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Status = Callable[[], dict[str, Any]]


class _StatusCollector:
    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self):
        info = self.status()
        for key in ("round", "version", "rounds_trained", "uploads"):
            if isinstance(info.get(key), (int, float)):
                yield GaugeMetricFamily(f"fedmq_{key}", f"current {key}", value=float(info[key]))
        if "agents_online" in info:
            count = info.get("agents_online_count", len(info["agents_online"]))
            yield GaugeMetricFamily("fedmq_agents_online", "agents seen within 3 heartbeats", value=count)
        for name in ("rejected", "dropped"):
            if name in info:
                fam = CounterMetricFamily(
                    f"fedmq_messages_{name}", f"messages {name}, by reason", labels=["reason"]
                )
                for reason, count in info[name].items():
                    fam.add_metric([reason], float(count))
                yield fam
        depths = info.get("queue_depths") or {}
        if depths:
            fam = GaugeMetricFamily(
                "fedmq_queue_depth", "messages ready in the job's queues", labels=["queue"]
            )
            for queue, depth in depths.items():
                fam.add_metric([queue], float(depth))
            yield fam
        broker = info.get("broker") or {}
        if "blocked" in broker:
            yield GaugeMetricFamily(
                "fedmq_broker_blocked",
                "1 while the broker blocks publishing (flow control)",
                value=float(bool(broker["blocked"])),
            )


class Telemetry:
    def __init__(self, status: Status, ready: Callable[[], bool]) -> None:
        self.status, self.ready = status, ready
        self.registry = CollectorRegistry()
        # self.status may be set later (simulate)
        self.registry.register(_StatusCollector(lambda: self.status()))
        self.rounds = Counter("fedmq_rounds", "closed rounds", ["outcome"], registry=self.registry)
        self.updates = Counter(
            "fedmq_updates_accepted", "updates folded into a global model", registry=self.registry
        )
        self.wire = Counter("fedmq_wire_bytes", "bytes on the wire", ["direction"], registry=self.registry)
        self.duration = Histogram(
            "fedmq_round_duration_seconds",
            "round wall time",
            registry=self.registry,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, float("inf")),
        )
        self.gauges: dict[str, Gauge] = {}  # created on their first value: no score reads as 0 before round 1
        self.server: ThreadingHTTPServer | None = None

    def observe_round(self, row: dict[str, Any]) -> None:
        self.rounds.labels("skipped" if row.get("skipped") else "completed").inc()
        self.updates.inc(len(row.get("received", [])))
        self.wire.labels("up").inc(row.get("bytes_up", 0))
        self.wire.labels("down").inc(row.get("bytes_down", 0))
        self.duration.observe(row.get("wall_s", 0.0))
        if row.get("valid") is not None:  # fedmq_validation_perplexity or fedmq_validation_bleu
            metric = re.sub(r"[^a-z0-9_]", "_", str(row.get("metric") or "score").lower())
            self._gauge(
                f"fedmq_validation_{metric}", f"validation {metric} of the global model, last evaluated round"
            ).set(row["valid"])
        if row.get("mean_loss") is not None:
            self._gauge(
                "fedmq_train_loss", "mean training loss the clients reported, last round with reports"
            ).set(row["mean_loss"])
        if row.get("epsilon") is not None:  # differential privacy: ε spent so far (δ: the row's "delta")
            self._gauge("fedmq_dp_epsilon", "privacy spent so far: epsilon at the job's delta").set(
                row["epsilon"]
            )

    def _gauge(self, name: str, documentation: str) -> Gauge:
        if name not in self.gauges:
            self.gauges[name] = Gauge(name, documentation, registry=self.registry)
        return self.gauges[name]

    def serve(self, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
        telemetry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    self._send(200, generate_latest(telemetry.registry), "text/plain; version=0.0.4")
                elif self.path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                elif self.path == "/readyz":
                    ok = bool(telemetry.ready())
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
                elif self.path == "/status":
                    self._send(200, json.dumps(telemetry.status(), default=str).encode(), "application/json")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True, name="metrics-http").start()
        return self.server

    def close(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()
