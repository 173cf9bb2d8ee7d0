"""Logging to stderr, as text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys

from kandevd.timeutil import UTC

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime

        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    """Set the lowest level logged (at start-up and on SIGHUP)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    # APScheduler is chatty at INFO about every job it runs.
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))


def current_level() -> str:
    return logging.getLevelName(logging.getLogger().level)
