"""The import graph of fedmq's packages (every import statement, also inside functions and TYPE_CHECKING blocks):
layers import one way and no module imports itself back through others (README "Layout").

The public names of ``import fedmq`` (fedmq/__init__.py) are resolved by name on first use, so that importing the
bottom layer never loads the layers above: test_public_names_resolve_and_the_bottom_layer_loads_nothing_above."""

from __future__ import annotations

import ast
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedmq", "broker", "aggregator", "client_agent", "cli", "benchmarks")
# what each layer may import besides itself: the shared bottom layer (fedmq), the transport (broker), the two
# sides of a federation (never each other), the benchmarks, then the CLI on top (it hands the benchmarks its
# Simulation and report: benchmarks/experiments.py)
ALLOWED = {
    "fedmq": set(),
    "broker": {"fedmq"},
    "aggregator": {"fedmq", "broker"},
    "client_agent": {"fedmq", "broker"},
    "benchmarks": {"fedmq", "broker", "aggregator", "client_agent"},
    "cli": {"fedmq", "broker", "aggregator", "client_agent", "benchmarks"},
}
# inside broker: the wire format (bytes in, bytes out) below the transport that carries it; every broker module
# is in one of the two
SUBLAYERS = {
    "broker.wire": {"fedmq"},
    "broker.transport": {"fedmq", "broker.wire"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                dep = owner(target) if target.split(".")[0] in PACKAGES else None
                if dep and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_import_one_way():
    graph = _graph()
    assert len(graph) > 50, "the scan found too few modules to mean anything"
    wrong = []
    for module, deps in graph.items():
        package = module.split(".")[0]
        for dep in deps:
            dep_package = dep.split(".")[0]
            if dep_package == package:
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in ALLOWED[package]):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_inside_broker_the_wire_format_sits_below_the_transport():
    broker_modules = [m for m in _modules() if m.startswith("broker.")]
    assert [m for m in broker_modules if not _within(m, SUBLAYERS)] == []
    wrong = []
    for module, deps in _graph().items():
        layer = next((s for s in SUBLAYERS if _within(module, [s])), None)
        if layer is None:
            continue
        wrong += [f"{module} -> {dep}" for dep in deps if not _within(dep, [layer, *SUBLAYERS[layer]])]
    assert wrong == []


PIKA_PRIVATE = ROOT / "broker" / "transport" / "pika_private.py"
# pika's private attributes the RabbitMQ backend uses (and _adapter, another way in); only PIKA_PRIVATE names them
PIKA_PRIVATES = re.compile(r"\._impl\b|\._transport\b|\._adapter|_MAX_RECV_BYTES|_closing_reason|_raise_if_not_open"
                           r"|_send_method")


def test_only_pika_private_touches_pikas_private_attributes():
    paths = [*_modules().values(), *(ROOT / "scripts").rglob("*.py")]
    assert PIKA_PRIVATE in paths
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in paths if path != PIKA_PRIVATE
            for n, line in enumerate(path.read_text().splitlines(), 1) if PIKA_PRIVATES.search(line)]
    assert hits == []
    assert PIKA_PRIVATES.search(PIKA_PRIVATE.read_text())


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_the_scan_finds_a_cycle_and_resolves_imports_to_modules():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "fedmq.tasks.base" in graph["aggregator.engine"]  # imports inside the package are resolved to modules


def test_public_names_resolve_and_the_bottom_layer_loads_nothing_above():
    code = ("import sys, fedmq.errors, fedmq.tasks.registry, fedmq.pulling; "
            "above = sorted(m for m in sys.modules if m.split('.')[0] in ('broker', 'aggregator', 'client_agent', "
            "'cli', 'benchmarks')); import fedmq; "
            "names = [getattr(fedmq, n) for n in fedmq.__all__]; print(above, len(names))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    import fedmq

    assert done.stdout.split() == ["[]", str(len(fedmq.__all__))]
    assert {"Task", "Strategy", "ClientUpdate", "TrainConfig", "TrainResult", "JobConfig", "Simulation"} <= set(
        fedmq.__all__)
