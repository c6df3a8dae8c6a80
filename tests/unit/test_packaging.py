"""What `pip install fedmq` puts into site-packages: one top-level package, ``fedmq``, built from the
repository's layer folders by pyproject's package-dir mapping (README "Layout")."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {"fedmq": "fedmq", **SETUPTOOLS["package-dir"]}


def _package_folders() -> set[str]:
    """Every package in the repository's layer folders, by the name it installs under."""
    found = set()
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    return found


def test_every_package_folder_is_listed_for_the_wheel():
    assert _package_folders() == set(SETUPTOOLS["packages"])


def test_the_wheel_installs_one_top_level_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--disable-pip-version-check",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("fedmq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"fedmq", wheel.name.split("-py")[0] + ".dist-info"}
    # the layers are inside it, under their installed names; the entry point names the installed CLI
    for module in (
        "fedmq/broker/wire/envelope.py",
        "fedmq/aggregator/engine.py",
        "fedmq/client_agent/agent.py",
        "fedmq/cli/app.py",
        "fedmq/simulation.py",
        "fedmq/tasks/lm.py",
    ):
        assert module in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fedmq = fedmq.cli.app:main" in zipfile.ZipFile(wheel).read(entry).decode()
