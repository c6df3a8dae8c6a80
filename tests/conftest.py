"""Shared fixtures: the real RabbitMQ on 127.0.0.1:5672 and the shared corpora in ../shared/data."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FEDMQ_DATA", ROOT.parent / "shared" / "data"))
RABBIT_URL = os.environ.get("FEDMQ_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
IN_CI = bool(os.environ.get("CI"))


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


_rabbit_state: dict[str, str | None] = {}


def rabbit_unavailable() -> str | None:
    """None when the shared broker answers (starting it if needed), else the reason it does not."""
    if "reason" not in _rabbit_state:
        reason = None
        if not _port_open("127.0.0.1", 5672):
            proc = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-rabbitmq.sh")], capture_output=True, text=True)
            if proc.returncode != 0 or not _port_open("127.0.0.1", 5672):
                reason = "RabbitMQ is not reachable on 127.0.0.1:5672: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
        _rabbit_state["reason"] = reason
    return _rabbit_state["reason"]


@pytest.fixture(scope="session")
def rabbit_url() -> str:
    """URL of the shared RabbitMQ. In CI a missing broker fails the run; elsewhere the test is skipped."""
    reason = rabbit_unavailable()
    if reason:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return RABBIT_URL


@pytest.fixture
def job_id() -> str:
    """A fresh job id so tests on the shared broker never see each other's queues."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.is_dir():
        if IN_CI:
            pytest.fail(f"shared corpora not found at {DATA}")
        pytest.skip(f"shared corpora not found at {DATA}")
    return DATA


def load_rabbit_node_module():
    """tests/rabbit_node.py (the isolated-node helper), importable under --import-mode=importlib."""
    import importlib.util
    import sys

    name = "fedmq_tests_rabbit_node"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "rabbit_node.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def rabbit_node(tmp_path_factory):
    """A private RabbitMQ node for tests that stop, kill or reconfigure a broker (see tests/rabbit_node.py).

    max_message_size is 16 MiB (RabbitMQ 4.x's default); it has a TLS listener with test certificates
    (``node.tls_url``, ``node.certs``) and the management API (``node.management_url``). Tests that stop or
    kill it must leave it running.
    """
    mod = load_rabbit_node_module()
    reason = mod.rabbit_node_unavailable()
    if reason:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    node = mod.RabbitNode(tmp_path_factory.mktemp("rabbit-node"), max_message_size=16 * 1024 * 1024, tls=True,
                          management=True)
    node.start()
    yield node
    node.stop()
