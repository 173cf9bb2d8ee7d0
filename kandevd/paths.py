"""Where things live: the home directory and the names inside it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = "~/.local/share/kandevd"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def resolve_home(option: str | os.PathLike[str] | None) -> Path:
    """``--home``, else ``$KANDEVD_HOME``, else ``~/.local/share/kandevd``."""
    raw = option or os.environ.get("KANDEVD_HOME") or DEFAULT_HOME
    return Path(raw).expanduser().resolve()


def ensure_dir(path: Path) -> Path:
    """Create ``path`` and every missing parent with mode 0700 (existing ones are left as is).

    ``Path.mkdir(parents=True, mode=...)`` applies the mode to the leaf only.
    """
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
    return path


def check_safe_name(value: str, what: str = "name") -> str:
    """Reject names that would escape their folder when used as a path part."""
    if not _SAFE_NAME.match(value) or value in {".", ".."}:
        raise ValueError(
            f"{what} {value!r} is not allowed: use letters, digits, '_', '-', '.' "
            "(starting with a letter or digit, at most 128 characters)"
        )
    return value


@dataclass(frozen=True)
class HomeLayout:
    root: Path

    @property
    def db(self) -> Path:
        return self.root / "kandevd.db"

    @property
    def socket(self) -> Path:
        return self.root / "kandevd.sock"

    @property
    def lock(self) -> Path:
        return self.root / "kandevd.lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def run_logs(self) -> Path:
        return self.root / "logs" / "runs"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def attempts(self) -> Path:
        """One folder per run attempt (the outcome journal), outside the agents' cwd."""
        return self.root / "attempts"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def prepare(self) -> None:
        ensure_dir(self.root)
        os.chmod(self.root, 0o700)
        ensure_dir(self.logs)
