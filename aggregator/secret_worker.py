"""A worker process of aggregator.secret_pool: ``python -P -m fedmq.aggregator.secret_worker``.

It reads batches of Shamir shares on its stdin and writes, for each batch, the secrets they combine into
(``fedmq.secagg.shamir.combine_each``; None where they do not combine) and the CPU seconds this process
has used since it started, both as length-prefixed msgpack. It exits when its stdin closes. It imports only
msgpack and the Shamir module (``-P``: nothing from the directory it was started in), and its stdout
carries nothing but frames: whatever else would be printed goes to its stderr.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack

from fedmq.secagg.shamir import combine_each

FRAME = struct.Struct(">I")  # a frame's length, then its msgpack
MAX_FRAME = 1 << 28  # 256 MiB: the shares of about a million secrets


def write_frame(fd: int, obj: Any, wait: Callable[[], None] = lambda: None) -> None:
    """``obj`` as one frame on ``fd``; ``wait`` runs before each write (a non-blocking fd's readiness)."""
    data = msgpack.packb(obj, use_bin_type=True)
    view = memoryview(FRAME.pack(len(data)) + data)
    while view:
        wait()
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # a non-blocking fd that filled up again: wait for room
            continue


def _read_exact(fd: int, size: int, wait: Callable[[], None]) -> bytes:
    chunks, left = [], size
    while left:
        wait()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the stream")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, wait: Callable[[], None] = lambda: None) -> Any:
    """One frame from ``fd`` (EOFError at the end of the stream, ValueError for one too long)."""
    (size,) = FRAME.unpack(_read_exact(fd, FRAME.size, wait))
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes, more than {MAX_FRAME}")
    return msgpack.unpackb(_read_exact(fd, size, wait), raw=False)


def serve(requests: int, answers: int) -> None:
    """The worker's loop: a batch of share lists in, [their secrets, this process's CPU seconds] out."""
    while True:
        try:
            batch = read_frame(requests)
        except EOFError:
            return
        write_frame(answers, [combine_each(batch), time.process_time()])


if __name__ == "__main__":
    answers = os.dup(1)
    os.dup2(2, 1)  # a stray print goes where stderr goes, never into the frames
    serve(0, answers)
