"""Writing a file whole or not at all: the new content goes to a temporary file beside it, which then replaces
it (``os.replace``), so that a reader, or a process restarted after a crash, finds the old file or the new
one, never half of one. Each write has a temporary of its own, so two processes writing one file (two
experiment processes sharing a grid) do not mix. ``durable`` also fsyncs the file and its folder before
returning, so that the new file survives a power cut (checkpoints, the round spool); ``private`` makes it
readable by its owner only from the moment it exists (credentials)."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def replacing(
    path: str | os.PathLike,
    *,
    text: bool = False,
    durable: bool = False,
    private: bool = False,
    reuse: Path | None = None,
) -> Iterator[IO[Any]]:
    """A file to write ``path``'s new content to (binary, or text in UTF-8 with ``text``): it replaces
    ``path`` when the block ends, and is removed instead when the block raises. ``reuse``: a file no longer
    needed, on the same file system, that becomes the temporary and is written over from its start (write
    the block's content in order: what the file held beyond the last write is cut off), where it is still a
    plain file with no other link: its pages are in the page cache already, where a new file's are fresh
    memory, whose first touch costs more than the copy into it (the host's, on a VM that gets freed memory
    back). Not with ``private`` (a reused file would keep its old permissions)."""
    path = Path(path)
    if reuse is not None and (private or reuse == path):
        raise ValueError("reuse: not for a private file, nor the file being replaced")
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # a dot first: no reader's glob sees it
    try:
        fd = _reused(reuse, tmp) if reuse is not None else -1
        if fd < 0:  # 0o666: the umask's
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb") as fh:
            yield fh
            if reuse is not None:
                fh.truncate()
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def _reused(old: Path, tmp: Path) -> int:
    """``old`` renamed to ``tmp`` and opened for writing; -1 (and ``old`` left alone) when it is gone
    (another writer took it) or is not a plain file of one link: a hard link's other name, or a reader
    holding it open by a link, would see it change."""
    try:
        if not _single_file(os.lstat(old)):
            return -1
        os.replace(old, tmp)
    except OSError:
        return -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        fd = -1
    if fd >= 0 and _single_file(os.fstat(fd)):
        return fd
    if fd >= 0:
        os.close(fd)
    tmp.unlink(missing_ok=True)  # linked again meanwhile: this name goes, the other stays as it was
    return -1


def _single_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def write_atomic(
    path: str | os.PathLike,
    data: bytes | str,
    *,
    durable: bool = False,
    private: bool = False,
    reuse: Path | None = None,
) -> None:
    """Replace ``path`` by ``data`` (a str is written as UTF-8), whole or not at all (module docstring;
    ``reuse``: see ``replacing``)."""
    with replacing(path, text=isinstance(data, str), durable=durable, private=private, reuse=reuse) as fh:
        fh.write(data)


def append_line(path: str | os.PathLike, line: bytes, *, durable: bool = False) -> None:
    """Append ``line`` (ending in a newline) to ``path``, creating the file if it is missing; ``durable``
    fsyncs it (and its folder when the file is new) before returning. A crash can leave the last line cut
    short (a reader skips a line it cannot parse): the next line then starts on a line of its own."""
    path = Path(path)
    new = durable and not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(path.parent)


def private_folder(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) readable by its owner only, or make an existing folder of this user's
    so: a run folder holds the trained model, its metrics and logs, which say as much about the clients' data
    as the checkpoints do. A folder another user owns is left as it is."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid == os.geteuid():
        path.chmod(0o700)
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (a file just created, replaced or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
