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


CHECKOV_VERSION = "3.3.30"
CHECKOV_VENV = ROOT / ".fedmq-cache" / "checkov-venv"


@pytest.fixture(scope="session")
def checkov() -> str:
    """The checkov executable: $FEDMQ_CHECKOV, else the separate venv .fedmq-cache/checkov-venv (created here
    from PyPI when missing: checkov's pins would downgrade packages of the project's venv), else PATH."""
    override = os.environ.get("FEDMQ_CHECKOV", "")
    if override:
        return override
    exe = CHECKOV_VENV / "bin" / "checkov"
    if not os.access(exe, os.X_OK):
        made = subprocess.run(["python3", "-m", "venv", str(CHECKOV_VENV)], capture_output=True, text=True)
        if made.returncode == 0:
            made = subprocess.run(
                [
                    str(CHECKOV_VENV / "bin" / "pip"),
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    f"checkov=={CHECKOV_VERSION}",
                ],
                capture_output=True,
                text=True,
                timeout=1200,
            )
        if made.returncode != 0 or not os.access(exe, os.X_OK):
            found = shutil.which("checkov")
            if found:
                return found
            missing_tool(
                f"checkov {CHECKOV_VERSION} could not be installed into {CHECKOV_VENV}: "
                + (made.stderr.strip().splitlines() or ["?"])[-1]
            )
    return str(exe)
