"""Shared fixtures: the real RabbitMQ on 127.0.0.1:5672 and the real corpora in the data folder
($FEDMQ_DATA_DIR, fedmq.tasks.corpora); tests that need a corpus that is not there are skipped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the tests' helper modules (fedmq_procs: fedmq processes forked from a preloaded server) import by name
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
# corpora kept in a folder beside the checkout (as on CI) serve the tests that read real corpora, unless
# FEDMQ_DATA_DIR names another data folder; subprocesses inherit it
_BESIDE = ROOT.parent / "shared" / "data"
if not os.environ.get("FEDMQ_DATA_DIR") and _BESIDE.is_dir():
    os.environ["FEDMQ_DATA_DIR"] = str(_BESIDE)
FIXTURE_CORPORA = ROOT / "tests" / "fixtures" / "corpora"  # slices of the real corpora, in the repository
RABBIT_URL = os.environ.get("FEDMQ_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/%2F")
IN_CI = bool(os.environ.get("CI"))


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    """`make test` runs three pytest-xdist workers (--dist loadgroup), on two cores too: much of the suite
    waits on process starts, RabbitMQ nodes and round deadlines. The tests that start their own RabbitMQ
    nodes or kill processes on a clock (tests/fault, and every isolated_node test) form one group, and so do
    the tests that measure speed itself (timing): one worker runs them one after the other, in file order,
    while the other workers take everything else. A test in tests/fault marked any_worker kills nothing and
    may run on any worker."""
    for item in items:
        faults = "/fault/" in str(item.path) and not item.get_closest_marker("any_worker")
        alone = item.get_closest_marker("isolated_node") or item.get_closest_marker("timing")
        if alone or faults:
            item.add_marker(pytest.mark.xdist_group("own-nodes-and-faults"))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's per-test limit (pyproject's ``timeout``, or a test's timeout mark) is an idle
    machine's seconds: scaled by the load when the test starts (tests/load_factor.py), so a busy machine does
    not kill a healthy test while a hung one still ends. pytest-timeout's own timer then runs the test."""
    import pytest_timeout
    from load_factor import budget

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=budget(settings.timeout)))


_rabbit_state: dict[str, str | None] = {}


def rabbit_unavailable() -> str | None:
    """None when the shared broker answers (starting it if needed), else the reason it does not."""
    if "reason" not in _rabbit_state:
        reason = None
        if not _port_open("127.0.0.1", 5672):
            proc = subprocess.run(
                ["bash", str(ROOT / "scripts" / "ensure-rabbitmq.sh")], capture_output=True, text=True
            )
            if proc.returncode != 0 or not _port_open("127.0.0.1", 5672):
                reason = (
                    "RabbitMQ is not reachable on 127.0.0.1:5672: "
                    + (proc.stderr.strip().splitlines() or ["?"])[-1]
                )
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


@pytest.fixture
def one_torch_thread():
    """Training tests run torch on one thread: faster when test workers share a few cores, and the same
    every run."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def real_corpus():
    """``real_corpus(name)``: the folder of a real corpus (ptb, wikitext-2, de-en) found the way fedmq finds
    it (fedmq.tasks.corpora.find: $FEDMQ_DATA_DIR, default ~/.cache/fedmq/data); the test is skipped when the
    corpus is not there."""
    from fedmq.tasks.corpora import find
    from fedmq.tasks.errors import TaskError

    def locate(name: str) -> Path:
        try:
            return find(name)
        except TaskError:
            pytest.skip(f"needs the {name} corpus in $FEDMQ_DATA_DIR")

    return locate


@pytest.fixture
def fixture_corpora(monkeypatch) -> Path:
    """FEDMQ_DATA_DIR pointed at tests/fixtures/corpora (this test and its subprocesses): the first lines of
    WikiText-2 and of the de-en domains news_wmt and ted_iwslt14, all the smoke scale of ``fedmq experiment``
    reads."""
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(FIXTURE_CORPORA))
    return FIXTURE_CORPORA


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


@pytest.fixture
def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a listener a test starts (tests/rabbit_node.free_port: below the
    kernel's ephemeral range, where no client connection can be holding it)."""
    return load_rabbit_node_module().free_port()


def _rabbit_node_module_or_skip():
    """tests/rabbit_node.py when private nodes can start here;
    else the test fails in CI and is skipped elsewhere."""
    mod = load_rabbit_node_module()
    reason = mod.rabbit_node_unavailable()
    if reason:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return mod


@pytest.fixture(scope="session")
def rabbit_node(tmp_path_factory):
    """A private RabbitMQ node for tests that stop, kill or reconfigure a broker (see tests/rabbit_node.py).

    max_message_size is 16 MiB (RabbitMQ 4.x's default); it has a TLS listener with test certificates
    (``node.tls_url``, ``node.certs``) and the management API (``node.management_url``). Tests that stop or
    kill it must leave it running.
    """
    mod = _rabbit_node_module_or_skip()
    node = mod.RabbitNode(
        tmp_path_factory.mktemp("rabbit-node"), max_message_size=16 * 1024 * 1024, tls=True, management=True
    )
    node.start()
    yield node
    node.stop()


@pytest.fixture
def rabbit_cluster(tmp_path_factory):
    """Three private RabbitMQ nodes on loopback joined into one cluster
    (tests/rabbit_node.py: RabbitCluster)."""
    mod = _rabbit_node_module_or_skip()
    with mod.RabbitCluster(tmp_path_factory.mktemp("rabbit-cluster"), size=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def own_rabbit_node(tmp_path_factory):
    """A private RabbitMQ node for one test module (default settings), for tests that kill it at odd moments;
    each test leaves it running."""
    mod = _rabbit_node_module_or_skip()
    node = mod.RabbitNode(tmp_path_factory.mktemp("own-rabbit-node"))
    node.start()
    yield node
    node.stop()


def run_in_process_federation(
    task,
    cfg,
    url: str,
    run_dir: Path,
    *,
    agent_class=None,
    evaluate: bool = True,
    keep_sent: bool = False,
    **agent_kw,
):
    """An Engine plus cfg.clients Agents (threads, one connection each) over ``url``, run to the end.

    ``agent_class(i)`` picks the class of agent i (e.g. a faulty one); ``keep_sent`` keeps what each agent
    uploaded per round so a test can recompute the aggregate. Returns (engine, agents, summary).
    """
    import threading

    from load_factor import budget

    from fedmq.aggregator.engine import Engine
    from fedmq.broker.transport import topology
    from fedmq.broker.transport.connect import connect
    from fedmq.client_agent.agent import Agent

    memory = url.startswith("memory")
    broker = connect(url, user=topology.AGGREGATOR_USER if memory else None)
    engine = Engine(broker, task, cfg, run_dir, durable=False, evaluate=evaluate)
    engine.declare()
    agents = []
    for i in range(cfg.clients):
        client = f"agent-{i}"
        cls = agent_class(i) if agent_class else Agent
        agent = cls(
            lambda c=client: connect(url, user=c if memory else None),
            cfg.job,
            client,
            i,
            task,
            heartbeat_s=cfg.heartbeat_s,
            rejoin_s=0.2,
            **agent_kw,
        )
        if keep_sent:
            agent.log.sent = {}
        agents.append(agent)
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        summary = engine.run()
    finally:
        for a in agents:
            a.stop.set()
        for t in threads:
            t.join(timeout=budget(10))
        broker.close()
    return engine, agents, summary


@pytest.fixture(scope="session")
def tiny_lm():
    """``tiny_lm(clients, cls=LanguageModelTask)``: the small language model the federation tests train (the
    builtin corpus cut to 600 lines and 500 words, a GRU 16 wide), as a task of ``clients`` clients."""
    from fedmq.tasks.lm import LanguageModelTask

    def make(clients: int, cls: type = LanguageModelTask):
        return cls(
            clients=clients,
            seed=0,
            data="builtin",
            model="gru-small",
            emb=16,
            hidden=16,
            vocab_size=500,
            max_lines=600,
            max_eval_lines=100,
            bptt=10,
            dropout=0.0,
        )

    return make


@pytest.fixture
def federation():
    """run_in_process_federation, for tests that run a whole federation in this process."""
    return run_in_process_federation
