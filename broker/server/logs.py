"""structlog set-up: JSON lines on stdout (journald keeps them), one key per fact.

Only the process entry point calls ``configure``; library code takes a bound logger.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> structlog.typing.FilteringBoundLogger:
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    # One line per event, promptly: stdout is a pipe to journald (or a file), not a tty.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger("memory-broker")
