"""tests/fedmq_procs.py, the tests' way to start fedmq commands and scripts: a forked child behaves as a fresh
`subprocess` child does (output, exit status, environment, folder, argv, sys.path, stdin, signals, process
group, timeouts), so a test cannot tell them apart except by the time they take to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import fedmq_procs
import pytest
from load_factor import budget

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "path0": sys.path[0], "extra": os.environ.get("PYTHONPATH", "") in sys.path,
                  "stdin": sys.stdin.read(), "pgid_is_pid": os.getpgid(0) == os.getpid()}))
print("to stderr", file=sys.stderr)
if sys.argv[1:2] == ["sleep"]:
    import time
    print("ready", flush=True)
    time.sleep(60)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return [sys.executable, str(path)]


def test_a_forked_script_gives_what_a_fresh_one_gives(script, tmp_path):
    extra = tmp_path / "lib"
    extra.mkdir()
    env = {**os.environ, "PROBE": "x", "CODE": "3", "PYTHONPATH": str(extra)}
    kwargs = dict(capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60, input="in")
    forked = fedmq_procs.run([*script, "a", "b c"], **kwargs)
    fresh = subprocess.run([*script, "a", "b c"], **kwargs)
    assert fedmq_procs._forkable(script) and forked.returncode == fresh.returncode == 3
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr == "to stderr\n"
    assert '"argv": ["a", "b c"]' in forked.stdout and '"extra": true' in forked.stdout


def test_signals_process_groups_and_timeouts_act_on_the_forked_child(script, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = fedmq_procs.popen(
            [*script, "sleep"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        assert isinstance(proc, fedmq_procs.Forked)
        assert proc.stdout.readline().startswith(b"{") and proc.stdout.readline() == b"ready\n"
        assert os.getpgid(proc.pid) == proc.pid and proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=budget(30)) == -sig
        proc.stdout.close()
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        fedmq_procs.run([*script, "sleep"], capture_output=True, timeout=1)
    assert time.monotonic() - started < 60, "the run waited for the child's own end (its 60 s sleep)"


def test_other_commands_and_fork_off_go_to_subprocess(script, monkeypatch):
    assert not fedmq_procs._forkable([sys.executable, "-c", "pass"])
    assert isinstance(fedmq_procs.popen([sys.executable, "-c", "pass"]), subprocess.Popen)
    monkeypatch.setenv("FEDMQ_TEST_FORK", "0")
    proc = fedmq_procs.popen([*script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=budget(60)) == 0
