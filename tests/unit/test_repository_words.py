"""The repository speaks of the software: no tracked text file talks about the process, people or machines
that built it (work sessions, machines lent for a while and their time budgets, diary dates, unlinked issue
numbers, documents kept outside the repository).

Every tracked text file (``git ls-files``) is read line by line against PHRASES: patterns, not bare words, so
that "session" in its pytest, TLS or HTTP sense, a trainer ``borrow``-ed from its pool or a colour like
``#0072B2`` stay allowed. A measured figure may name the date and the machine it was measured on ("measured
2026-11-22 on a 2-core x86 VM"); what it may not do is keep a diary ("since 2026-11-25") or point to the
machine the text was written on ("this machine's CPU"). Binary files, data (JSON, JSONL, CSV) and test
fixtures (tests/fixtures/) are skipped, and so is this file, which has to spell the phrases out."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
FIXTURES = ("tests/fixtures/",)  # test data, e.g. slices of real corpora: text nobody here wrote
DATA_SUFFIXES = {
    ".json",
    ".jsonl",
    ".csv",
    ".tsv",
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".svg",
    ".pdf",
    ".pt",
    ".gz",
}

# (name, pattern, only in files with these suffixes or None for every text file); matched case-insensitively
PHRASES: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("a numbered work session", r"\bsessions? \d", None),
    (
        "a work session",
        r"\b(?:work|GPU|device|later|next|earlier|previous|lent) sessions?\b|\bacross (?:work )?sessions\b"
        r"|\bin the session (?:that|which)\b|\bsession's (?:device|time|compute|budget)\b",
        None,
    ),
    ("a work period", r"\bwork periods?\b", None),
    ("a machine lent or borrowed", r"\blent\b|\bborrowed (?:GPU|machine|H100|device|accelerator)s?\b", None),
    ("a time budget on a lent machine", r"\bdevice[- ]time\b|\bdevice-minutes?\b", None),
    ("a GPU call or session", r"\bGPU (?:call|session)s?\b", None),
    ("the design card", r"\bdesign (?:card|sketch)\b", None),
    ("a document kept outside the repository", r"\bDESIGN\.md\b", None),
    ("a folder outside the repository", r"\.\./shared\b", None),
    ("an issue number", r"\bissues? #?\d", None),
    # '#' and digits, not inside a word, a URL (removed before matching), a shell length or a colour
    ("an unlinked issue number", r"(?<![\w/&$#{])#\d{1,4}\b", None),
    ("a diary date", r"\b(?:since|until) 20\d\d-\d\d", None),
    ("the people who built it", r"\bother engineers\b|\bthe team\b", None),
    (
        "the machine the text was written on",
        r"\bthis (?:2-core |two-core |shared |dev |development )?(?:machine|VM)(?:'s)?\b"
        r"|\bthe GPU machine\b|\bdev(?:elopment)? (?:machine|VM)\b",
        (".md",),
    ),
    (
        "the machine the text was written on",
        r"\bthis (?:2-core|two-core|shared|dev|development) (?:machine|VM)\b"
        r"|\bthe GPU machine\b|\bdev(?:elopment)? (?:machine|VM)\b",
        None,
    ),
]
COMPILED = [(name, re.compile(pattern, re.IGNORECASE), only) for name, pattern, only in PHRASES]
URL = re.compile(r"\bhttps?://\S+")


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to read")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [p for p in out.split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary, data or (in this working tree) deleted file."""
    if path.suffix.lower() in DATA_SUFFIXES or not path.is_file():
        return None
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(name: str, text: str) -> list[str]:
    """``name:line: phrase: text`` for every line of ``text`` (the file ``name``) that matches a phrase."""
    suffix = Path(name).suffix.lower()
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        bare = URL.sub("", line)
        for phrase, pattern, only in COMPILED:
            if (only is None or suffix in only) and pattern.search(bare):
                found.append(f"{name}:{number}: {phrase}: {line.strip()[:160]}")
                break
    return found


def test_no_tracked_text_file_talks_about_the_process():
    found = []
    for name in _tracked():
        if name == SELF or name.startswith(FIXTURES):
            continue
        text = _text(ROOT / name)
        if text is not None:
            found += hits(name, text)
    assert not found, "process talk in the repository (rewrite it to speak of the software):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "line",
    [
        "measured in session 20 (2026-11-25)",
        "a run cannot resume in a later session",
        "keep the finished runs across sessions",
        "more than a session's device time",
        "Some sessions are lent one H100",
        "the machine is borrowed GPU time",
        "15 device-minutes a session; before spending device time",
        "the next GPU call measures it",
        "Libraries added beyond the design card",
        "the synchronous round (DESIGN.md)",
        "fedmq bench cohort --data ../shared/data/ptb",
        "bounded decoding (issue 16.2)",
        "what issue #14 asks for",
        "the choices behind it (#17)",
        "since 2026-11-25 a cohort run gives",
        "evaluated on the CPU until 2026-11-24",
        "while other engineers' jobs ran",
        "On this machine's CPU one round took 174 s",
        "measured on the 2-core dev machine",
    ],
)
def test_process_talk_is_found(line):
    assert hits("docs/x.md", line) and hits("x.py", line.replace("this machine", "this 2-core machine"))


@pytest.mark.parametrize(
    "line",
    [
        '@pytest.fixture(scope="session")',
        "Every overlay rendered once per session: overlay name -> list of objects.",
        "must not leak into this test session",
        "start_new_session=True,",
        "the session's node with tests/integration/test_rabbit_faults.py",
        "def test_markov_sessions_and_stationary_share():",
        "with self.trainers.borrow() as model:",
        'BLUE = "#0072B2"; GREY = "#999999"; BLACK = "#000000"',
        'assert runs == ["x/run", "x/run#2"]',
        "see https://github.com/pika/pika/issues/1234#issuecomment-1",
        'echo "${#arr[@]}"',
        "rabbitmqctl on this machine (optionally -n NODE)",
        "CUDA is not available on this machine; this machine's cores",
        "measured 2026-11-22 on a 2-core x86 VM",
        "a TLS session resumes; the HTTP session cookie",
        "the client opens a session with the broker; each session keeps its cookie; this session's ticket",
    ],
)
def test_software_words_are_allowed(line):
    assert not hits("x.py", line)
