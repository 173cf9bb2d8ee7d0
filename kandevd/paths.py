"""Where things live: the home directory and the names inside it.

A home kandevd creates is made 0700. An existing home is used with the mode it
has: kandevd never chmods it (the owner may have opened it to a group on
purpose), it logs a warning naming the mode found when that is not 0700, and
it refuses to start (exit 73, :class:`HomeError`) when it cannot write there.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from kandevd.fsutil import ensure_dir, make_spread_dirs

DEFAULT_HOME = "~/.local/share/kandevd"
ADVISED_MODE = 0o700

log = logging.getLogger("kandevd.home")


def inside(raw: object, folder: Path) -> Path | None:
    """``raw`` (a path a file names) with its links resolved, when that is inside
    ``folder`` (also resolved); None otherwise. For logs a history entry names: whoever
    can write the entry must not make a reader print any file it can read."""
    if not isinstance(raw, str) or not raw:
        return None
    try:
        path = Path(os.path.realpath(raw))
        root = Path(os.path.realpath(folder))
    except (OSError, ValueError):
        return None
    return path if root in path.parents else None


class HomeError(OSError):
    """The home cannot be created or written (exit 73); the message says why, in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def resolve_home(option: str | os.PathLike[str] | None) -> Path:
    """``--home``, else ``$KANDEVD_HOME``, else ``~/.local/share/kandevd``."""
    raw = option or os.environ.get("KANDEVD_HOME") or DEFAULT_HOME
    return Path(raw).expanduser().resolve()


def check_safe_name(value: str, what: str = "name") -> str:
    """Reject names that would escape their folder when used as a path part."""
    if not _SAFE_NAME.match(value) or value in {".", ".."}:
        raise ValueError(
            f"{what} {value!r} is not allowed: use letters, digits, '_', '-', '.' "
            "(starting with a letter or digit, at most 128 characters)"
        )
    return value


#: The attempt journal's folder in a home (see :mod:`kandevd.runtime.attempts`).
ATTEMPTS_FOLDER = "attempts"


@dataclass(frozen=True)
class HomeLayout:
    """The files and folders of a home (each path built once: some are asked for per run)."""

    root: Path

    @cached_property
    def db(self) -> Path:
        return self.root / "kandevd.db"

    @cached_property
    def socket(self) -> Path:
        return self.root / "kandevd.sock"

    @cached_property
    def lock(self) -> Path:
        return self.root / "kandevd.lock"

    @cached_property
    def logs(self) -> Path:
        return self.root / "logs"

    @cached_property
    def run_logs(self) -> Path:
        return self.root / "logs" / "runs"

    @cached_property
    def runs(self) -> Path:
        return self.root / "runs"

    @cached_property
    def attempts(self) -> Path:
        """One folder per run attempt (the outcome journal), outside the agents' cwd."""
        return self.root / ATTEMPTS_FOLDER

    @cached_property
    def turns(self) -> Path:
        """One folder per scheduled turn while it runs (its execution record), so a
        later daemon can adopt the turn (see :mod:`kandevd.schedules.restart.adopted`)."""
        return self.root / "turns"

    @cached_property
    def root_prefix(self) -> str:
        """The home as the start of the paths inside it (``/home/x/`` for ``/home/x``)."""
        return str(self.root).rstrip(os.sep) + os.sep

    @cached_property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def prepare(self, warn: Callable[[str], None] | None = None) -> list[str]:
        """Create what is missing (0700) and check the home can be used; never chmod.

        Returns the warnings (also passed to ``warn``, by default logged): the
        mode of an existing home that is not 0700. Raises :class:`HomeError`
        when the home cannot be created, is not a directory, or is not writable.
        """
        created = not os.path.lexists(self.root)
        try:
            ensure_dir(self.root)
        except OSError as exc:
            if not created:  # (ensure_dir: NotADirectoryError)
                raise HomeError("it exists and is not a directory") from None
            raise HomeError(f"cannot create it: {exc.strerror or exc}") from None
        try:
            info = os.stat(self.root)
        except OSError as exc:
            raise HomeError(f"cannot use it: {exc.strerror or exc}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise HomeError("it exists and is not a directory")
        warnings = [] if created else home_mode_warnings(self.root, info)
        for message in warnings:
            (warn or log.warning)(message)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise HomeError(_not_writable(self.root, info))
        if created:  # (the folders that take files for every run, away from files freed
            # lately; an existing home is left as it is)
            make_spread_dirs(self.root, (self.logs.name, self.runs.name, ATTEMPTS_FOLDER))
        try:
            ensure_dir(self.logs)
        except OSError as exc:
            raise HomeError(f"cannot create {self.logs}: {exc.strerror or exc}") from None
        return warnings


def home_mode_warnings(root: Path, info: os.stat_result) -> list[str]:
    """Why an existing home's mode is not the advised 0700, or nothing when it is."""
    mode = stat.S_IMODE(info.st_mode) & 0o777
    if mode == ADVISED_MODE:
        return []
    reasons = []
    others = mode & 0o077
    if others:
        who = " and ".join(w for w, bits in (("group", 0o070), ("others", 0o007))
                           if others & bits)
        reasons.append(f"it is open to {who}, and it holds the database, the run logs and "
                       "the control socket")
    missing = ADVISED_MODE & ~mode
    if missing:
        reasons.append("its owner lacks " + "/".join(
            name for name, bit in (("read", 0o400), ("write", 0o200), ("search", 0o100))
            if missing & bit) + " permission, which kandevd needs there")
    return [f"home {root} has mode {mode:04o}, not the advised 0700 ({'; '.join(reasons)}); "
            f"it is used as it is, not changed (chmod 700 {root} to follow the advice)"]


def _not_writable(root: Path, info: os.stat_result) -> str:
    try:
        read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "it is on a read-only file system" if read_only else (
        f"mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}, kandevd runs as uid "
        f"{os.geteuid()}")
    return (f"cannot write it ({why}): kandevd creates its lock, database, socket and logs "
            "there; make it writable or choose another --home")
