"""Help that reads well at an 80-column terminal, like the ML tools fedmq's users know (argparse, Lightning).

Plain text, not rich's option table: click's formatter wraps but never truncates (rich cut option names and
choice lists to "…" at 80 columns) and has no markup to eat ``[task]``. Options are grouped in sections by
their ``rich_help_panel=`` and show argparse-style metavars (``--batch-size N``; ``--job JOB`` where none is
given) instead of ``<int>``/``<bool>``.
"""

from __future__ import annotations

from typing import Any

from typer._click.formatting import HelpFormatter
from typer.core import TyperArgument, TyperCommand, TyperGroup

_NB_HYPHEN = "\u2011"


class _Formatter(HelpFormatter):
    """Wraps at spaces only: never inside --option-names, gru-small, int8-row or dp-random (hyphens are
    swapped for non-breaking ones while wrapping and back on output)."""

    def write(self, string: str) -> None:
        super().write(string.replace(_NB_HYPHEN, "-"))

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _NB_HYPHEN))

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        super().write_dl([(a, b.replace("-", _NB_HYPHEN)) for a, b in rows], col_max, col_spacing)


class HelpCommand(TyperCommand):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if (
                not isinstance(param, TyperArgument)
                and param.metavar is None
                and not getattr(param, "is_flag", False)
            ):
                param.metavar = (param.name or "value").upper()

    def get_help(self, ctx: Any) -> str:
        formatter = _Formatter(width=ctx.terminal_width, max_width=ctx.max_content_width)
        self.format_help(ctx, formatter)
        return formatter.getvalue().rstrip("\n")

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                pieces.append(_argument(param) if param.required else f"[{_argument(param)}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if not record:
                continue
            section = "Options"
            if isinstance(param, TyperArgument):  # RUN_DIRS... rather than "RUN_DIRS <list[Path]>"
                section = "Arguments"
                record = (_argument(param), record[1])
            sections.setdefault(getattr(param, "rich_help_panel", None) or section, []).append(record)
        if len(sections) > 1 and "Options" in sections and sections["Options"][0][0] == "--help":
            sections[list(sections)[-2]] += sections.pop("Options")  # --help joins the last panel
        for name, rows in sections.items():
            with formatter.section(name):
                formatter.write_dl(rows)


class HelpGroup(TyperGroup):
    """A command group whose command list shows each command's first paragraph wrapped, not cut to "..."."""

    def get_help(self, ctx: Any) -> str:
        formatter = _Formatter(width=ctx.terminal_width, max_width=ctx.max_content_width)
        self.format_help(ctx, formatter)
        return formatter.getvalue().rstrip("\n")

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                text = cmd.short_help or (cmd.help or "").split("\n\n")[0]
                rows.append((name, " ".join(text.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _argument(param: TyperArgument) -> str:
    return (param.metavar or (param.name or "arg").upper()) + ("..." if param.nargs != 1 else "")
