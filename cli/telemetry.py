"""Prometheus metrics plus /healthz and /readyz on one small HTTP server (for Kubernetes probes)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily


class _StatusCollector:
    """Exports a status() dict as fedmq_* metrics at scrape time (no second source of truth)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self):
        info = self.status()
        for key in ("round", "version", "rounds_trained"):
            if key in info:
                yield GaugeMetricFamily(f"fedmq_{key}", f"current {key}", value=float(info[key]))
        if "agents_online" in info:
            yield GaugeMetricFamily("fedmq_agents_online", "agents seen within 3 heartbeats", value=len(info["agents_online"]))
        for name in ("rejected", "dropped"):
            if name in info:
                fam = CounterMetricFamily(f"fedmq_messages_{name}", f"messages {name} by reason", labels=["reason"])
                for reason, count in info[name].items():
                    fam.add_metric([reason], float(count))
                yield fam
        row = info.get("last_metrics") or {}
        for key in ("bytes_up", "bytes_down", "wall_s", "valid"):
            if isinstance(row.get(key), (int, float)):
                yield GaugeMetricFamily(f"fedmq_last_round_{key}", f"{key} of the last closed round", value=float(row[key]))


def serve(port: int, status: Callable[[], dict[str, Any]], ready: Callable[[], bool]) -> ThreadingHTTPServer:
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif self.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif self.path == "/readyz":
                ok = bool(ready())
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
            elif self.path == "/status":
                self._send(200, json.dumps(status(), default=str).encode(), "application/json")
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

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server
