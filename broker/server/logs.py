"""structlog set-up: one event per line on stdout, one key per fact, rendered by structlog's own
renderers: JSON lines where a program reads them (journald, a file, a pipe), aligned
human-readable lines (ConsoleRenderer) on a terminal, or either one forced by ``--log-format``.

Only the process entry point calls ``configure`` (and a reload, to change the level);
library code takes a bound logger. What libraries (and this project's own library code, such
as the native-core loader) say through Python's ``logging`` is routed into the same stream and
rendered the same way, so a ``json`` stream holds JSON lines only.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from memory_broker.broker.doors.policy import merge_call
from memory_broker.broker.server.values import LOG_FORMATS

# The format the last ``configure`` chose ("auto" resolved), kept when a reload changes only
# the level.
_format: str | None = None
# The handler ``configure`` put on the root of Python's logging (replaced by the next call).
_stdlib_handler: logging.Handler | None = None


def resolve_format(fmt: str, stream: TextIO) -> str:
    """``auto`` -> ``console`` on a terminal, ``json`` otherwise; the others as given."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use {', '.join(LOG_FORMATS)}")
    if fmt != "auto":
        return fmt
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def configure(
    level: str = "info", fmt: str | None = None, stream: TextIO | None = None
) -> structlog.typing.FilteringBoundLogger:
    """Route structlog events at ``level`` and above to ``stream`` (default stdout).

    Args:
        level: debug, info, warning or error.
        fmt: auto, console or json; None keeps the format of the previous call (auto at first).
        stream: where lines go; ``auto`` asks it whether it is a terminal.
    Raises:
        ValueError: an unknown level or format.
    """
    global _format
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    stream = stream if stream is not None else sys.stdout
    chosen = resolve_format(fmt, stream) if fmt is not None else (_format or resolve_format("auto", stream))
    # One line per event, promptly: stdout is often a pipe to journald or a file.
    if hasattr(stream, "reconfigure"):
        stream.reconfigure(line_buffering=True)
    if chosen == "console":
        colors = bool(getattr(stream, "isatty", lambda: False)())
        renderer = structlog.dev.ConsoleRenderer(colors=colors)
        exc = []  # ConsoleRenderer formats exceptions itself
    else:
        renderer = structlog.processors.JSONRenderer()
        exc = [structlog.processors.format_exc_info]
    stamp = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    route_stdlib(lvl, stream, [structlog.stdlib.add_logger_name, *stamp, *exc], renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            merge_call,
            *stamp,
            *exc,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _format = chosen
    return structlog.get_logger("memory-broker")


def route_stdlib(level: int, stream: TextIO, chain: list, renderer) -> None:
    """Render Python ``logging`` records at ``level`` and above as structlog events on ``stream``
    (the record's message is the event, its logger name a key), in place of the handler a
    previous call installed; records sent before the first call went to ``logging``'s default."""
    global _stdlib_handler
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=chain,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _stdlib_handler is not None:
        root.removeHandler(_stdlib_handler)
    root.addHandler(handler)
    root.setLevel(level)
    _stdlib_handler = handler
