"""The benchmarks' markdown tables, drawn one way."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], right_from: int | None = None) -> str:
    """A markdown table: a header of ``columns``, then a line per row of cells (each written with str());
    the columns from index ``right_from`` on are right-aligned."""
    rule = "".join(
        "---:|" if right_from is not None and i >= right_from else "---|" for i in range(len(columns))
    )
    lines = ["| " + " | ".join(columns) + " |", "|" + rule]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
