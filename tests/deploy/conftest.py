"""Fixtures of the deploy tests: the rendered overlays and the external tools (kubectl, checkov)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ("dev", "gpu", "chaos")
IN_CI = bool(os.environ.get("CI"))


def missing_tool(reason: str) -> None:
    """A tool the deploy tests need is absent: fail in CI, skip (with the reason) elsewhere."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        missing_tool("kubectl not found (it renders the kustomize overlays); see docs/deploy.md")
    assert exe is not None
    return exe


def render(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH` parsed into objects (offline: every base and component is a local folder)."""
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed: {proc.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay rendered once per session: overlay name -> list of objects."""
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def checkov() -> str:
    """The checkov executable: $FEDMQ_CHECKOV, else the separate venv .fedmq-cache/checkov-venv, else PATH."""
    candidates = [os.environ.get("FEDMQ_CHECKOV", ""), str(ROOT / ".fedmq-cache" / "checkov-venv" / "bin" / "checkov")]
    for cand in candidates:
        if cand and os.access(cand, os.X_OK):
            return cand
    exe = shutil.which("checkov")
    if exe is None:
        missing_tool("checkov not found: create its venv with `python3 -m venv .fedmq-cache/checkov-venv && "
                     ".fedmq-cache/checkov-venv/bin/pip install checkov==3.3.30` (see docs/deploy.md)")
    assert exe is not None
    return exe
