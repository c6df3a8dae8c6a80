"""What `pip install fedmq` puts into site-packages: one top-level package, ``fedmq``, built from the
repository's layer folders by pyproject's package-dir mapping (README "Layout"); and what the images
(docker/) install: a wheel built from exactly the files their Dockerfiles copy, which runs the CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {"fedmq": "fedmq", **SETUPTOOLS["package-dir"]}
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))


def _ignore_rules() -> list[tuple[bool, re.Pattern[str], str]]:
    """The repository's .dockerignore as (excludes, pattern, text) in order. The last rule that matches a path
    or one of its parent folders decides (Docker's rules: ``*`` within a name, ``**`` any folders, ``!``
    keeps)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        text = line.lstrip("!").strip("/")
        parts = []
        for part in text.split("/"):
            if part == "**":
                parts.append("(?:[^/]+/)*")
            else:
                part = re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
                parts.append(part + "/")
        rules.append((not keep, re.compile("".join(parts).removesuffix("/") + r"\Z"), text))
    return rules


def build_context() -> set[str]:
    """The files an image build is sent: its context, the repository root less what .dockerignore drops."""
    rules = _ignore_rules()

    def excluded(rel: str) -> bool:
        prefixes = ["/".join(rel.split("/")[: i + 1]) for i in range(rel.count("/") + 1)]
        verdict = False
        for excludes, pattern, _ in rules:
            if any(pattern.match(p) for p in prefixes):
                verdict = excludes
        return verdict

    found = set()
    for folder, dirs, files in os.walk(ROOT):
        rel_dir = Path(folder).relative_to(ROOT).as_posix() if folder != str(ROOT) else ""
        for d in list(dirs):
            rel = f"{rel_dir}/{d}".lstrip("/")
            # a dropped folder is skipped unless a later ``!`` rule names something inside it
            if excluded(rel) and not any(not ex and text.startswith(rel) for ex, _, text in rules):
                dirs.remove(d)
        found |= {rel for f in files if not excluded(rel := f"{rel_dir}/{f}".lstrip("/"))}
    return found


def copied(dockerfile: Path, context: set[str]) -> set[str]:
    """The files of the build context that ``dockerfile`` copies (its COPY steps but those from a stage)."""
    out = set()
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", dockerfile.read_text(), re.M):
        for src in [word for word in line.split()[:-1] if not word.startswith("--")]:
            src = "" if src in (".", "./") else src.removeprefix("./").rstrip("/")
            out |= {f for f in context if not src or f == src or f.startswith(src + "/")}
    return out


def _package_folders() -> set[str]:
    """Every package in the repository's layer folders, by the name it installs under."""
    found = set()
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    return found


def test_every_package_folder_is_listed_for_the_wheel():
    assert _package_folders() == set(SETUPTOOLS["packages"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_copies_every_folder_the_package_is_built_from(dockerfile: Path):
    files = copied(dockerfile, build_context())
    assert {"pyproject.toml", "README.md"} <= files
    for folder in FOLDERS.values():
        sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")}
        assert sources <= files, f"{dockerfile.name} leaves out {sorted(sources - files)[:5]}"
    # and nothing else: the context is what the package is built from
    assert {f.split("/")[0] for f in files} == {"pyproject.toml", "README.md", *FOLDERS.values()}


@pytest.fixture(scope="module")
def image_wheel(tmp_path_factory) -> Path:
    """The wheel built from exactly the files the Dockerfiles copy (the same in both)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    (files,) = {frozenset(copied(d, build_context())) for d in DOCKERFILES}
    src = tmp_path / "src"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
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
    return wheel


def test_the_wheel_installs_one_top_level_package(image_wheel: Path):
    wheel = image_wheel
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


def test_the_images_wheel_installs_and_runs_the_cli(image_wheel: Path, tmp_path: Path):
    """What `pip install .` in an image gives: the CLI runs from the installed wheel alone. The venv sees
    this one's packages (torch and the rest) through a .pth file, after its own: no download, no editable
    checkout on its path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--no-index", str(image_wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [python, "-c", "import fedmq.cli.app, fedmq.benchmarks; print(fedmq.cli.app.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(site)
    cli = subprocess.run(
        [venv / "bin" / "fedmq", "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "simulate" in cli.stdout
