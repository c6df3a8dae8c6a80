"""The import graph of fedmq's packages (every import statement, also inside functions and TYPE_CHECKING
blocks): layers import one way and no module imports itself back through others (README "Layout").

The public names of ``import fedmq`` (fedmq/__init__.py) are resolved by name on first use, so that importing
the bottom layer never loads the layers above:
test_public_names_resolve_and_the_bottom_layer_loads_nothing_above."""

from __future__ import annotations

import ast
import collections
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where each subpackage of the one installed package lives in the repository (pyproject's package-dir)
FOLDERS = {
    "fedmq": "fedmq",
    **tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"],
}
# the layers, bottom to top, and what each may import besides itself: the shared bottom layer (fedmq's own
# modules: errors, checks, files, tasks, the pulling rule), the transport (broker), the two sides of a
# federation (never each other), the in-process federation that wires them (simulation), the benchmarks, then
# the CLI on top. A module belongs to the longest prefix below that names it.
ALLOWED = {
    "fedmq": set(),
    "fedmq.broker": {"fedmq"},
    "fedmq.aggregator": {"fedmq", "fedmq.broker"},
    "fedmq.client_agent": {"fedmq", "fedmq.broker"},
    "fedmq.simulation": {"fedmq", "fedmq.broker", "fedmq.aggregator", "fedmq.client_agent"},
    "fedmq.benchmarks": {
        "fedmq",
        "fedmq.broker",
        "fedmq.aggregator",
        "fedmq.client_agent",
        "fedmq.simulation",
    },
    "fedmq.cli": {
        "fedmq",
        "fedmq.broker",
        "fedmq.aggregator",
        "fedmq.client_agent",
        "fedmq.simulation",
        "fedmq.benchmarks",
    },
}
# inside broker: the wire format (bytes in, bytes out) below the transport that carries it;
# every broker module is in one of the two
SUBLAYERS = {
    "fedmq.broker.wire": {"fedmq", "fedmq.broker.wire"},
    "fedmq.broker.transport": {"fedmq", "fedmq.broker.wire", "fedmq.broker.transport"},
}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> str:
    return max((name for name in ALLOWED if _within(module, [name])), key=len)


def _modules() -> dict[str, Path]:
    mods = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = ".".join((package, *path.relative_to(ROOT / folder).with_suffix("").parts))
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
                dep = owner(target) if target.split(".")[0] == "fedmq" else None
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
        own = layer(module)
        wrong += [f"{module} -> {dep}" for dep in deps if layer(dep) not in {own, *ALLOWED[own]}]
    assert wrong == []


def test_inside_broker_the_wire_format_sits_below_the_transport():
    broker_modules = [m for m in _modules() if m.startswith("fedmq.broker.")]
    assert [m for m in broker_modules if not _within(m, SUBLAYERS)] == []
    wrong = []
    for module, deps in _graph().items():
        sub = next((s for s in SUBLAYERS if _within(module, [s])), None)
        if sub is None:
            continue
        # the bottom layer (fedmq's own modules) is named "fedmq", a prefix of every module: compare by layer
        wrong += [
            f"{module} -> {dep}"
            for dep in deps
            if not (layer(dep) == "fedmq" or _within(dep, SUBLAYERS[sub] - {"fedmq"}))
        ]
    assert wrong == []


PIKA_PRIVATE = ROOT / "broker" / "transport" / "pika_private.py"
# pika's private attributes the RabbitMQ backend uses (and _adapter, another way in);
# only PIKA_PRIVATE names them
PIKA_PRIVATES = re.compile(
    r"\._impl\b|\._transport\b|\._adapter|_MAX_RECV_BYTES|_closing_reason|_raise_if_not_open"
    r"|_send_method"
)


def test_only_pika_private_touches_pikas_private_attributes():
    paths = [*_modules().values(), *(ROOT / "scripts").rglob("*.py")]
    assert PIKA_PRIVATE in paths
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in paths
        if path != PIKA_PRIVATE
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PIKA_PRIVATES.search(line)
    ]
    assert hits == []
    assert PIKA_PRIVATES.search(PIKA_PRIVATE.read_text())


def test_nothing_imports_a_folder_by_its_name_instead_of_its_package():
    """``broker``, ``cli`` … are folders of the repository, not packages: code, tests and scripts import them
    as ``fedmq.broker``, ``fedmq.cli`` …; the old names would only work from a checkout's root, if at all."""
    folders = set(FOLDERS.values()) - {"fedmq"}
    paths = [*_modules().values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    wrong = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            wrong += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in folders
            ]
    assert wrong == []


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_the_scan_finds_a_cycle_and_resolves_imports_to_modules():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert (
        "fedmq.tasks.base" in graph["fedmq.aggregator.engine"]
    )  # imports inside the package are resolved to modules


def test_public_names_resolve_and_the_bottom_layer_loads_nothing_above():
    code = (
        "import sys, fedmq.errors, fedmq.tasks.registry, fedmq.pulling; "
        "above = sorted(m for m in sys.modules if m.startswith('fedmq.') and m.split('.')[1] in ('broker', "
        "'aggregator', 'client_agent', 'simulation', 'cli', 'benchmarks')); import fedmq; "
        "names = [getattr(fedmq, n) for n in fedmq.__all__]; print(above, len(names))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    import fedmq

    assert done.stdout.split() == ["[]", str(len(fedmq.__all__))]
    assert {
        "Task",
        "Strategy",
        "ClientUpdate",
        "TrainConfig",
        "TrainResult",
        "JobConfig",
        "Simulation",
    } <= set(fedmq.__all__)
