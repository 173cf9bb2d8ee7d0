"""Reading logs for the console: only files under the home's ``logs/`` folder.

A history entry names its turns' logs, and a workflow root's files can be
edited by anyone who can write them: a path outside the logs folder is never
opened, whatever the entry says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: The end of a log shown on a page (the live view streams the rest).
TAIL_BYTES = 64 * 1024


def log_root(console: Any) -> Path:
    return Path(console.home) / "logs"


def safe_log_path(console: Any, raw: Any) -> Path | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        path = Path(os.path.realpath(raw))
        root = Path(os.path.realpath(log_root(console)))
    except (OSError, ValueError):
        return None
    if root not in path.parents:
        return None
    return path


def readable_log(console: Any, raw: Any, limit: int = TAIL_BYTES) -> dict[str, Any]:
    """``{text, size, truncated}`` of a log's end ("" when there is none (yet))."""
    path = safe_log_path(console, raw)
    if path is None:
        return {"text": "", "size": 0, "truncated": False, "refused": bool(raw)}
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(0, size - limit)
            handle.seek(start)
            data = handle.read(limit)
    except OSError:
        return {"text": "", "size": 0, "truncated": False, "refused": False}
    return {"text": data.decode("utf-8", "replace"), "size": size, "truncated": start > 0,
            "refused": False}
