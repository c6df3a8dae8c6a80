"""A population the host cannot hold (the memory of its virtual clients, the threads of those in a round
at once) is refused at start, in one line, with exit code 2: never started half-way into MemoryError."""

from __future__ import annotations

import re

import fedmq_procs
import pytest

from fedmq.population import PopulationTooLarge, check_population, limits


def _kind(fact: str) -> str:
    return re.sub(r"[\d.,]+", "N", fact)


def test_the_limits_are_read_from_the_host_and_name_their_fact():
    found = limits()  # every client in a round at once (asynchronous rounds): a thread each
    assert found, "no limit could be read"
    assert all(n >= 0 and fact for n, fact in found)
    # a client that is not in a round has no thread: a round of 1 in 1,000 is bound by fewer facts, higher
    assert limits(1e-3)[0][0] > found[0][0] or "memory" in found[0][1]
    # the same facts (their figures move with the host's free memory between two reads)
    assert [_kind(fact) for _, fact in limits(0)] == [_kind(fact) for _, fact in found if "memory" in fact]
    check_population(1)
    with pytest.raises(PopulationTooLarge, match=r"at most \d+ clients"):
        check_population(found[0][0] + 1)


def test_simulate_refuses_a_population_too_large_in_one_line_and_exits_2(tmp_path):
    proc = fedmq_procs.run(
        fedmq_procs.command(
            "simulate",
            "-k",
            "10000000",
            "-r",
            "1",
            "--out",
            str(tmp_path / "o"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "10000000" in lines[0] and "at most" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    # refused before anything started: no round was logged
    assert not (tmp_path / "o" / "metrics.jsonl").exists()
