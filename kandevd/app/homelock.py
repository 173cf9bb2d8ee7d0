"""The single-instance lock: ``<home>/kandevd.lock`` holding the daemon's pid.

This is a plain ``fcntl.flock`` on a file opened without truncation, not
``filelock.FileLock``: filelock opens its lock file with ``O_TRUNC``, so a
second daemon merely *trying* the lock would wipe the pid the first one
wrote, and the "already running (pid N)" message could not name N. The
kernel releases the lock when the process dies, so a ``kill -9`` never
leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class HomeLocked(Exception):
    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"home is in use: {path} is held by a running kandevd ({holder})")
        self.pid = pid


class HomeLock:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = read_pid(self.path)
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise HomeLocked(self.path, holder) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def read_pid(path: Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def holder(path: Path) -> int | None:
    """The pid of the kandevd that holds the lock at ``path`` now, None when none does
    as far as can be seen: the pid it wrote, still a kandevd process. (Looked at without
    trying the lock: a try could make a daemon starting that instant fail to take it.)"""
    pid = read_pid(path)
    if not pid:
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"kandevd" in command else None
