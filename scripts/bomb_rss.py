"""Peak memory of a real `fedmq aggregator run` process while it handles one zstd bomb (docs/reliability.md).

Starts the aggregator (default task, identity shared:guest) on a fresh job, waits until it consumes its inbox,
resets its peak RSS (/proc/PID/clear_refs), publishes one small update whose zstd body declares SIZE bytes of
zeros, waits for the rejection in its log and prints its VmRSS before and VmHWM after.
Then stops it and deletes the job's queues.

    python scripts/bomb_rss.py [--broker URL] [--size-mib 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import zstandard as zstd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedmq.broker.transport import topology  # noqa: E402
from fedmq.broker.transport.connect import connect  # noqa: E402
from fedmq.broker.transport.provision import purge  # noqa: E402
from fedmq.broker.wire.blobs import digest  # noqa: E402
from fedmq.broker.wire.envelope import MAGIC, SCHEMA_VERSION  # noqa: E402


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def bomb(job: str, size: int) -> bytes:
    """An update envelope whose tensors are a bin of ``size`` zeros, zstd'ed with its size declared."""
    head = msgpack.packb(["update", job, 1, "agent-0", 0, "bomb", time.time()], use_bin_type=True)
    prefix = (
        b"\x98"
        + head[1:]
        + b"\x83"
        + msgpack.packb("loss")
        + msgpack.packb(1.0)
        + msgpack.packb("n_samples")
        + msgpack.packb(10)
        + msgpack.packb("tensors")
        + b"\xc6"
        + size.to_bytes(4, "big")
    )
    z = zstd.ZstdCompressor(level=1, write_content_size=True).compressobj(size=len(prefix) + size)
    parts, block = [z.compress(prefix)], bytes(1 << 20)
    for _ in range(size >> 20):
        parts.append(z.compress(block))
    parts.append(z.flush())
    body = b"".join(parts)
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, 1)), digest(body), body))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--size-mib", type=int, default=2047)  # the bin32 length field stops just under 4 GiB
    args = ap.parse_args()
    job = "bomb" + uuid.uuid4().hex[:8]
    body = bomb(job, args.size_mib << 20)
    tmp = Path(tempfile.mkdtemp(prefix="bomb-rss-"))
    (tmp / "job.toml").write_text('identity = "shared:guest"\nrounds = 1\nclients = 1\n')
    cmd = [
        sys.executable,
        "-m",
        "fedmq.cli.app",
        "aggregator",
        "run",
        "--broker",
        args.broker,
        "--job",
        job,
        "--config",
        str(tmp / "job.toml"),
        "--state-dir",
        str(tmp / "state"),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1]
    )
    log = tmp / "state" / "logs" / "aggregator.jsonl"
    pub = connect(args.broker)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and "waiting for the first delivery" in log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"aggregator did not start (exit {proc.poll()})")
            time.sleep(0.2)
        time.sleep(1.0)
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss0 = kib(proc.pid, "VmRSS")
        t0 = time.monotonic()
        pub.publish(topology.rk_update(job, "agent-0"), body)
        reason = None
        while reason is None and time.monotonic() - t0 < 120 and proc.poll() is None:
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("event") == "message rejected":
                    reason = rec.get("reason")
            time.sleep(0.05)
        took = time.monotonic() - t0
        peak = kib(proc.pid, "VmHWM") if proc.poll() is None else None
        print(
            json.dumps(
                {
                    "wire_bytes": len(body),
                    "declared_bytes": args.size_mib << 20,
                    "reason": reason,
                    "rss_before_mb": round(rss0 / 1024),
                    "peak_mb": peak and round(peak / 1024),
                    "seconds_to_reject": round(took, 2),
                }
            )
        )
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        pub.close()
        purge(args.broker, job, ["agent-0"])


if __name__ == "__main__":
    main()
