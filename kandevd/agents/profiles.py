"""How an agent profile's command is found: the check ``validate`` and the runner share."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def executable_problem(name: str, cwd: Path, path_env: str | None) -> str | None:
    """Why ``name`` cannot be executed (the error text), or None when it can.

    Looked up like ``execvp`` in the child would: a name with a ``/`` is a
    path (relative to the child's ``cwd``), any other is searched in its PATH.
    """
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else cwd / name
        if not os.path.exists(candidate):
            return f"cannot start agent: executable not found: {name}"
        if os.path.isdir(candidate) or not os.access(candidate, os.X_OK):
            return f"cannot start agent: permission denied: {name}"
        return None
    search = path_env if path_env is not None else os.defpath
    if name and shutil.which(name, path=search) is not None:
        return None
    if name:  # like execvp: a match that is not executable is "permission denied"
        for directory in search.split(os.pathsep):
            if os.path.exists(os.path.join(directory or ".", name)):
                return f"cannot start agent: permission denied: {name}"
    return f"cannot start agent: executable not found: {name}"

