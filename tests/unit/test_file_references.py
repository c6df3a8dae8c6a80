"""Every repository path a tracked text file names exists: docs, comments and docstrings that point a
reader to ``docs/…md`` or ``aggregator/…py`` stay true when files move. A path is a top-level folder of the
repository followed by a file name with an extension (``cli/app.py``, ``docs/deploy.md``); paths inside the
installed package (``fedmq/aggregator/…``, as a wheel lays it out) and made-up examples in tests are not
references."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (
    "docs",
    "k8s",
    "docker",
    "tests",
    "scripts",
    "aggregator",
    "broker",
    "client_agent",
    "cli",
    "benchmarks",
)
SUFFIXES = ("md", "py", "png", "yaml", "yml", "toml", "sh", "json", "txt", "ipynb")
# a top-level folder (or fedmq/ itself) and a file in it, not inside a longer path, word or URL
PATH = re.compile(
    rf"(?<![\w/.$~-])((?:{'|'.join(FOLDERS)}|fedmq(?!/(?:{'|'.join(FOLDERS)})/))/[\w./-]*\.(?:{'|'.join(SUFFIXES)}))\b"
)
# files whose paths are examples, not references
EXAMPLES = ("tests/unit/test_repository_words.py", "tests/unit/test_file_references.py")


def _tracked_text() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.sh", "*.toml", "*.yaml", "*.yml", "Makefile", "docker/*"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [f for f in out if f not in EXAMPLES and not f.startswith("tests/fixtures/")]


def test_every_named_repository_file_exists():
    missing = [
        f"{name}:{number}: {match.group(1)}"
        for name in _tracked_text()
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        for match in PATH.finditer(line)
        if not (ROOT / match.group(1)).exists()
    ]
    assert not missing, "\n".join(missing)


def test_the_pattern_finds_paths_and_leaves_other_text():
    found = [m.group(1) for m in PATH.finditer("see cli/app.py, docs/deploy.md and fedmq/files.py.")]
    assert found == ["cli/app.py", "docs/deploy.md", "fedmq/files.py"]
    assert not list(PATH.finditer("fedmq/aggregator/engine.py https://x.org/docs/a.md aggregator/agent"))
