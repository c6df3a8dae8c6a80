"""structlog set-up: JSON lines for services (and when not a terminal), readable console for humans."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

from fedmq.files import private_folder

LEVELS = ("debug", "info", "warning", "error")


def configure(
    level: str = "info", fmt: str = "auto", file: Path | None = None, console_level: str | None = None
) -> None:
    """fmt: "json" | "console" | "auto" (console on a TTY). ``file`` also receives JSON lines, at ``level``;
    ``console_level`` (default ``level``) is the terminal's: a progress display keeps it to warnings while the
    run's log file still gets every event."""
    console_level = console_level or level
    for name in (level, console_level):
        if name not in LEVELS:
            raise ValueError(f"unknown log level {name!r}; use one of {', '.join(LEVELS)}")
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers[0].setFormatter(
        structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared)
    )
    handlers[0].addFilter(_not_file_only)
    handlers[0].setLevel(console_level.upper())
    if file is not None:
        private_folder(file.parent)
        fh = logging.FileHandler(file)
        fh.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processors=[
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
                foreign_pre_chain=shared,
            )
        )
        handlers.append(fh)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(min(logging.getLevelName(level.upper()), logging.getLevelName(console_level.upper())))
    # pika logs every failed connection attempt at ERROR with a traceback; fedmq logs its own one-line summary
    logging.getLogger("pika").setLevel(
        logging.DEBUG if "debug" in (level, console_level) else logging.CRITICAL
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def _not_file_only(record: logging.LogRecord) -> bool:
    """Events logged with ``file_only=True`` (a failure's traceback, when the user gets its cause in one line)
    go to the run's log file, not to the terminal."""
    return not (isinstance(record.msg, dict) and record.msg.get("file_only"))
