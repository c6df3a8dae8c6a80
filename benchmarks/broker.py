"""`fedmq bench broker`: publish/consume throughput of model-sized updates through fedmq's broker layer,
raw pika with publisher confirms (same node, same queue, same run) and the in-process broker.

Every path publishes persistent messages with ``mandatory`` and waits for each confirm, into the job inbox
(a quorum queue), then consumes them with manual acks (prefetch 64). fedmq's path chunks bodies over the
chunk limit (8 MiB) and hands them through its I/O and dispatcher threads; raw pika sends one message.
``fedmq-unchunked`` is fedmq's path with a 120 MiB chunk limit (fine on 3.10, not on 4.x): the difference
between the two fedmq rows is the cost of chunking (two xxh3 passes per side and, on the consuming side, one
copy joining the chunks; the publishing side sends the chunks from views of the body), the rest is the
transport.

Noise (the machine is shared): in each repeat every path runs once, in an order rotated between repeats; the
"vs pika" columns are the median over repeats of the ratio *within* a repeat (paths seconds apart), not a
ratio of medians. "CPU s/GB" is this process's CPU time (all threads, ``time.process_time``) per GB moved,
a load-robust measure of the client-side work (for ``memory`` it includes the in-process broker).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from typing import Any

import pika

from fedmq.benchmarks import markdown
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.connect import connect

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
MB = 1024 * 1024
UNCHUNKED = 120 * MB  # under RabbitMQ 3.10's 128 MiB max_message_size: isolates the transport from chunking


def _count_for(size_mb: int) -> int:
    return max(3, min(60, int(120 / size_mb)))


Trial = tuple[float, float, float, float]  # publish s, consume s, publish CPU s, consume CPU s


def _fedmq_trial(url: str, job: str, body: bytes, n: int, **kw: Any) -> Trial:
    with connect(url, **kw) as pub, connect(url, **kw) as sub:
        pub.declare_job(job, ["bench"])
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            pub.publish(t.rk_update(job, "bench"), body, message_id=f"m{i}-{uuid.uuid4().hex[:6]}")
        t_pub, c_pub = time.perf_counter() - t0, time.process_time() - c0
        got, done = [0], threading.Event()

        def handler(d: Any) -> None:
            sub.ack(d)
            got[0] += 1
            if got[0] == n:
                done.set()

        c0, t0 = time.process_time(), time.perf_counter()
        sub.consume(t.q_inbox(job), handler)
        if not done.wait(600):
            raise RuntimeError(f"fedmq consumed {got[0]} of {n}")
        t_con, c_con = time.perf_counter() - t0, time.process_time() - c0
    return t_pub, t_con, c_pub, c_con


def _pika_trial(url: str, job: str, body: bytes, n: int) -> Trial:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2, user_id="guest")
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        ch.basic_publish(
            t.exchange(job),
            t.rk_update(job, "bench"),
            body,
            pika.BasicProperties(delivery_mode=2, user_id=props.user_id, message_id=f"m{i}"),
            mandatory=True,
        )
    t_pub, c_pub = time.perf_counter() - t0, time.process_time() - c0
    cch = conn.channel()
    cch.basic_qos(prefetch_count=64)
    got = [0]

    def on_message(c: Any, method: Any, _props: Any, _body: bytes) -> None:
        c.basic_ack(method.delivery_tag)
        got[0] += 1

    c0, t0 = time.process_time(), time.perf_counter()
    cch.basic_consume(t.q_inbox(job), on_message)
    deadline = time.monotonic() + 600
    while got[0] < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    t_con, c_con = time.perf_counter() - t0, time.process_time() - c0
    conn.close()
    if got[0] < n:
        raise RuntimeError(f"pika consumed {got[0]} of {n}")
    return t_pub, t_con, c_pub, c_con


def _cleanup(url: str, job: str) -> None:
    if url.startswith("memory://"):
        return
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for q in (t.q_inbox(job), t.q_latest(job, "bench"), t.q_control(job, "bench")):
        ch.queue_delete(q)
    conn.close()


def bench_broker(
    sizes_mb: tuple[int, ...] = (1, 10, 100),
    repeats: int = 3,
    url: str = DEFAULT_URL,
    paths: tuple[str, ...] = ("fedmq", "fedmq-unchunked", "pika", "memory"),
) -> list[dict[str, Any]]:
    """One row per (path, size): median MB/s, msg/s and client CPU s/GB of publishing (confirmed) and
    consuming (acked); for every path, when "pika" ran, the median over repeats of its same-repeat ratio
    to raw pika."""
    job = "bench" + uuid.uuid4().hex[:8]
    with connect(url) as b:  # the topology every path uses
        b.declare_job(job, ["bench"])
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes_mb:
            body = os.urandom(size * MB)
            n = _count_for(size)
            trials: dict[str, list[Trial]] = {p: [] for p in paths}
            for rep in range(repeats):
                # interleaved (load changes on the shared machine hit every path alike), order rotated
                for p in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                    if p == "fedmq":
                        trials[p].append(_fedmq_trial(url, job, body, n))
                    elif p == "fedmq-unchunked":
                        trials[p].append(_fedmq_trial(url, job, body, n, chunk_limit=UNCHUNKED))
                    elif p == "pika":
                        trials[p].append(_pika_trial(url, job, body, n))
                    else:
                        trials[p].append(_fedmq_trial(f"memory://bench-{job}", job, body, n))
            gb = size * n / 1024
            for p in paths:
                tp = statistics.median(x[0] for x in trials[p])
                tc = statistics.median(x[1] for x in trials[p])
                row = {
                    "path": p,
                    "size_mb": size,
                    "messages": n,
                    "repeats": repeats,
                    "publish_MBps": size * n / tp,
                    "publish_msgps": n / tp,
                    "consume_MBps": size * n / tc,
                    "consume_msgps": n / tc,
                    "publish_cpu_s_per_GB": statistics.median(x[2] for x in trials[p]) / gb,
                    "consume_cpu_s_per_GB": statistics.median(x[3] for x in trials[p]) / gb,
                }
                if "pika" in trials:  # same-repeat ratios: time of pika / time of this path
                    pairs = list(zip(trials[p], trials["pika"]))
                    row["publish_vs_pika"] = statistics.median(ref[0] / x[0] for x, ref in pairs)
                    row["consume_vs_pika"] = statistics.median(ref[1] / x[1] for x, ref in pairs)
                rows.append(row)
    finally:
        _cleanup(url, job)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    columns = (
        "path, size MB, msgs, publish MB/s, publish msg/s, consume MB/s, consume msg/s, publish vs pika, "
        "consume vs pika, publish CPU s/GB, consume CPU s/GB"
    ).split(", ")
    cells = [
        [
            r["path"],
            r["size_mb"],
            r["messages"],
            f"{r['publish_MBps']:.1f}",
            f"{r['publish_msgps']:.1f}",
            f"{r['consume_MBps']:.1f}",
            f"{r['consume_msgps']:.1f}",
            f"{r['publish_vs_pika']:.0%}" if "publish_vs_pika" in r else "-",
            f"{r['consume_vs_pika']:.0%}" if "consume_vs_pika" in r else "-",
            f"{r['publish_cpu_s_per_GB']:.2f}",
            f"{r['consume_cpu_s_per_GB']:.2f}",
        ]
        for r in rows
    ]
    return markdown.table(columns, cells)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=DEFAULT_URL)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="1,10,100", help="comma-separated MB")
    a = ap.parse_args(argv)
    rows = bench_broker(tuple(int(s) for s in a.sizes.split(",")), a.repeats, a.url)
    print(format_table(rows))  # noqa: T201 - a command's output


if __name__ == "__main__":
    main()
