"""``fedmq`` with connection options the agent CLI has no flag for yet (run as ``python agent_shim.py agent run …``).

The fault suite needs an agent whose updates span several chunks (a tiny chunk limit) and whose dead connection is
noticed within seconds (a short AMQP heartbeat). ``fedmq agent run`` builds its connection with
``broker.connect.connect(url)`` and the library defaults (8 MiB chunks, 30 s heartbeat), so this shim wraps that
function with ``FEDMQ_CHUNK_LIMIT`` (bytes) and ``FEDMQ_HEARTBEAT`` (seconds) from the environment and then runs the
unchanged CLI. Everything else (the agent, the broker client, the codec) is the real code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import broker.connect as _bc  # noqa: E402

_connect = _bc.connect


def _connect_with_env(url, **kw):
    if os.environ.get("FEDMQ_CHUNK_LIMIT"):
        kw.setdefault("chunk_limit", int(os.environ["FEDMQ_CHUNK_LIMIT"]))
    if os.environ.get("FEDMQ_HEARTBEAT"):
        kw.setdefault("heartbeat", int(os.environ["FEDMQ_HEARTBEAT"]))
    return _connect(url, **kw)


_bc.connect = _connect_with_env

if __name__ == "__main__":
    from cli.app import app

    app(prog_name="fedmq")
