"""`fedmq` processes for the tests, forked from a server that has already imported torch.

The suite starts a few hundred `fedmq` processes (``python -m fedmq.cli.app …``, the ``fedmq`` script, an
example script), and most of a fresh one's start is ``import torch``: over a second of CPU on a machine the
suite keeps busy. Here each pytest process keeps one small server that imports torch, numpy and the other
heavy libraries (and fedmq's library layers) once and forks a child for each command. The child sets its
argv, environment, working directory and standard streams as the command asked, and runs the command. It is a
real, separate process: a test signals it by pid (kill -9 included), reads its pipes and gets its exit status
as from ``subprocess``.

`popen` and `run` take the arguments of ``subprocess.Popen`` and ``subprocess.run`` (the subset the tests
use); any other command, or any command while ``FEDMQ_TEST_FORK=0``, goes to ``subprocess`` unchanged. What
a forked child does not repeat of a fresh interpreter: the interpreter's start-up options
(``PYTHONHASHSEED`` and the like; ``PYTHONUNBUFFERED``, ``PYTHONPATH`` and ``OMP_NUM_THREADS`` are honoured)
and its final clean-up (threads are joined and atexit functions run, then the process ends). A test of how a
process exits (tests/integration/test_clean_exit.py), or of what a command imports, starts it fresh.
"""

from __future__ import annotations

import io
import json
import locale
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from load_factor import budget

FEDMQ_SCRIPT = str(Path(sys.executable).parent / "fedmq")
MODULE_CMD = [sys.executable, "-m", "fedmq.cli.app"]
ROOT = Path(__file__).resolve().parents[1]
# imported once, by the server: the heavy libraries, then fedmq's library layers (they read the environment
# when a command runs, never at import); the CLI module and a command's own modules (--task) are the child's
PRELOAD = (
    "torch",
    "numpy",
    "pika",
    "msgpack",
    "zstandard",
    "structlog",
    "typer",
    "fedmq.broker.transport.connect",
    "fedmq.tasks.registry",
    "fedmq.tasks.lm",
    "fedmq.aggregator.engine",
    "fedmq.client_agent.agent",
    "fedmq.client_agent.host",
    "fedmq.simulation",
)
_HEADER = struct.Struct("!I")


def _forkable(cmd: Sequence[str]) -> bool:
    """A fedmq command (``python -m fedmq.cli.app``, the ``fedmq`` script) or a Python script file."""
    cmd = [str(c) for c in cmd]
    script = len(cmd) > 1 and cmd[0] == sys.executable and cmd[1].endswith(".py")
    return cmd[:3] == MODULE_CMD or (len(cmd) > 0 and cmd[0] == FEDMQ_SCRIPT) or script


def _child_argv(cmd: list[str]) -> list[str]:
    """The child's sys.argv: ``-m fedmq.cli.app`` -> the module's name first (run_module puts its path
    there); the script or the ``fedmq`` script -> as given, without the interpreter."""
    if cmd[:3] == MODULE_CMD:
        return ["fedmq.cli.app", *cmd[3:]]
    return cmd[1:] if cmd[0] == sys.executable else cmd


def enabled() -> bool:
    return os.environ.get("FEDMQ_TEST_FORK", "1") != "0"


# ---------------------------------------------------------------------------------------------- the server


def serve(path: str) -> None:
    """Import the heavy libraries, then fork a child for each request on the UNIX socket `path` until stdin
    closes (the pytest process that started the server is gone); children still running then are killed."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a child that needs it imports it and reports the error itself
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # `path` appears only once the socket listens (a client that found it between bind and listen was
    # refused, on a busy machine)
    listener.bind(path + ".new")
    listener.listen(128)
    os.rename(path + ".new", path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                _send_line(conn, str(pid))
            elif key.data == "child":
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                _reap(children)
            else:
                if not os.read(sys.stdin.fileno(), 4096):
                    for pid in children:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                    os._exit(0)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send_line(conn, str(os.waitstatus_to_exitcode(status)))
            conn.close()


def _send_line(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall((line + "\n").encode())
    except OSError:  # the test stopped listening (it dropped the process object)
        pass


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request: its length, its JSON, and the three fds that came with its first bytes."""

    def at_least(data: bytes, size: int) -> bytes:
        while len(data) < size:
            more = conn.recv(1 << 16)
            if not more:
                raise ValueError("short request")
            data += more
        return data

    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    data = at_least(data, _HEADER.size)
    (size,) = _HEADER.unpack_from(data)
    data = at_least(data, _HEADER.size + size)
    return json.loads(data[_HEADER.size : _HEADER.size + size]), list(fds)


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the command, run it, exit with its status."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        # sys.path[0] as a fresh interpreter's: the script's folder, or (-m) the working directory
        sys.path[0] = "" if argv[0] == "fedmq.cli.app" else os.path.dirname(os.path.abspath(argv[0]))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
        if os.environ.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = list(argv)
        code = _run_cli()
    except BaseException:  # noqa: BLE001 - the child must end here whatever happened
        import traceback

        os.write(2, traceback.format_exc().encode(errors="replace"))
        code = 1
    finally:
        os._exit(code)


def _standard_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on the new fds 0-2, buffered as a fresh interpreter's (``-u``: unbuffered)."""

    def binary(fd: int, mode: str) -> Any:
        raw = io.FileIO(fd, mode, closefd=False)
        if unbuffered and mode == "wb":
            return raw
        return io.BufferedWriter(raw) if mode == "wb" else io.BufferedReader(raw)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(binary(0, "rb"), errors="surrogateescape")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        binary(1, "wb"), errors="surrogateescape", write_through=unbuffered
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        binary(2, "wb"), errors="backslashreplace", line_buffering=True
    )


def _run_cli() -> int:
    import atexit
    import traceback

    code: int = 0
    interrupted = False
    try:
        import runpy

        if sys.argv[0] == FEDMQ_SCRIPT:
            from fedmq.cli.app import main

            main()
        elif sys.argv[0] == "fedmq.cli.app":
            runpy.run_module("fedmq.cli.app", run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - as the interpreter does: print it, exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if interrupted:  # an uncaught KeyboardInterrupt ends the process by SIGINT, as in CPython
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


# ---------------------------------------------------------------------------------------------- the client

_server_lock = threading.Lock()
_server: dict[int, tuple[subprocess.Popen, str]] = {}  # pid of the pytest process -> (server, socket path)


def _socket_path() -> str:
    with _server_lock:
        mine = _server.get(os.getpid())
        if mine is not None and mine[0].poll() is None:
            return mine[1]
        folder = tempfile.mkdtemp(prefix="fedmq-forks-")
        path = os.path.join(folder, "s")
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        here = str(Path(__file__).resolve().parent)
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {here!r}); import fedmq_procs; fedmq_procs.serve({path!r})",
            ],
            stdin=subprocess.PIPE,
            env=env,
            cwd=folder,
        )
        deadline = time.monotonic() + budget(120)
        while not os.path.exists(path):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (exit {server.poll()})")
            time.sleep(0.05)
        _server[os.getpid()] = (server, path)
        return path


def _fd_for(spec: Any, default: int, opened: list[int]) -> tuple[int, int | None]:
    """(fd the child gets, our end of a pipe or None) for a Popen stdin/stdout/stderr argument."""
    if spec is None:
        return default, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        opened.append(w if default != 0 else r)
        return (r, w) if default == 0 else (w, r)
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd, None
    if spec == subprocess.STDOUT:
        return -2, None
    return (spec if isinstance(spec, int) else spec.fileno()), None


class Forked:
    """A forked fedmq child, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(
        self,
        args: Sequence[str],
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        start_new_session: bool = False,
        text: bool = False,
        universal_newlines: bool = False,
    ) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        self.text = text or universal_newlines
        self._buffered = b""
        closing: list[int] = []
        in_fd, in_mine = _fd_for(stdin, 0, closing)
        out_fd, out_mine = _fd_for(stdout, 1, closing)
        err_fd, err_mine = _fd_for(stderr, 2, closing)
        if err_fd == -2:
            err_fd = out_fd
        request = {
            "argv": _child_argv([str(a) for a in self.args]),
            "env": dict(os.environ if env is None else env),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": start_new_session,
        }
        payload = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(_socket_path())
            socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], [in_fd, out_fd, err_fd])
            self.pid = int(self._line(conn, None))
        except BaseException:
            conn.close()
            for fd in (in_mine, out_mine, err_mine):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in closing:
                os.close(fd)
        self._conn = conn
        self.stdin = open(in_mine, "w" if self.text else "wb") if in_mine is not None else None
        mode = "r" if self.text else "rb"
        self.stdout = open(out_mine, mode) if out_mine is not None else None
        self.stderr = open(err_mine, mode) if err_mine is not None else None

    def _line(self, conn: socket.socket, timeout: float | None) -> str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffered:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            conn.settimeout(left)
            try:
                more = conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            if not more:
                raise RuntimeError("the fork server went away")
            self._buffered += more
        line, self._buffered = self._buffered.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(self._conn, 0.0))
                self._conn.close()
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(self._conn, timeout))
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
            self.stdin = None
        chunks: dict[int, list[bytes]] = getattr(self, "_chunks", None) or {}
        self._chunks = chunks
        sel = selectors.DefaultSelector()
        for stream in (self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                sel.register(stream.fileno(), selectors.EVENT_READ)
                chunks.setdefault(stream.fileno(), [])
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                sel.close()
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
        sel.close()
        outs = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                outs.append(None)
                continue
            data = b"".join(chunks.pop(stream.fileno(), [])) if not stream.closed else b""
            stream.close()
            outs.append(data.decode(locale.getpreferredencoding(False)) if self.text else data)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return outs[0], outs[1]

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def popen(args: Sequence[str], **kwargs: Any) -> Any:
    """``subprocess.Popen(args, **kwargs)``, forked from the server where `args` is a fedmq command."""
    if enabled() and _forkable(args):
        return Forked(args, **kwargs)
    return subprocess.Popen(args, **kwargs)


def run(
    args: Sequence[str],
    *,
    input: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)``, forked from the server where `args` is a fedmq command; ``timeout`` is
    an idle machine's seconds (tests/load_factor.py scales it)."""
    timeout = None if timeout is None else budget(timeout)
    if not (enabled() and _forkable(args)):
        return subprocess.run(
            args, input=input, capture_output=capture_output, timeout=timeout, check=check, **kwargs
        )
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = Forked(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def command(*args: Any) -> list[str]:
    """The command line of ``fedmq ARGS`` in this interpreter (a command the server forks)."""
    return [*MODULE_CMD, *map(str, args)]


def fedmq(
    *args: Any, cwd: str | Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``fedmq ARGS`` run to its end in ``cwd`` (the repository by default), its output captured as text."""
    return run(command(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
