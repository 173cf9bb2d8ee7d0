"""Atomic, locked JSON files: the one way kandevd writes under the workflow root.

Every file kandevd keeps next to a user's workflows (run history, the global
pause, decisions, manifests, product state) goes through :class:`JsonFile`:

* **Atomic.** A write goes to a temp file in the same folder, is fsync'ed,
  renamed over the target, and the folder is fsync'ed: a reader (or a crash)
  sees the old content or the new, never half of it.
* **Locked.** Read-modify-write (:meth:`JsonFile.update`) holds a ``filelock``
  lock file beside the target (``<name>.lock``) for the whole cycle, so two
  processes appending to one history lose no entry.
* **Never destructive.** A file that does not parse is moved aside to
  ``<name>.corrupt-<timestamp>`` (never overwritten, never deleted), the problem
  is logged and handed to the ``on_corrupt`` reporter, and the caller starts
  from the default. Callers that must not start over (a manifest: its other
  keys are the user's) use :meth:`JsonFile.read_strict`, which raises instead.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.jsonfile")

T = TypeVar("T")

#: How long a writer waits for another process's lock before giving up.
LOCK_TIMEOUT_S = 30.0


class JsonFileError(Exception):
    """A JSON file that cannot be read or written; the message names the path."""


@dataclass(frozen=True)
class CorruptFile:
    """A file that did not parse and was moved aside."""

    path: str
    moved_to: str
    error: str
    at: str


CorruptReporter = Callable[[CorruptFile], None]


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str) -> Any:
    """Strict JSON: NaN and Infinity are rejected (other tools cannot read them)."""
    return json.loads(text, parse_constant=_strict_constant)


def dumps(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


class JsonFile:
    """One JSON file: atomic writes, a lock beside it, corrupt content moved aside."""

    def __init__(self, path: Path, *, on_corrupt: CorruptReporter | None = None) -> None:
        self.path = Path(path)
        self._on_corrupt = on_corrupt

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def lock(self) -> FileLock:
        """The inter-process lock guarding this file (re-entrant within a thread)."""
        return FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S)

    # -- reading -----------------------------------------------------------------
    def read_strict(self) -> Any:
        """The parsed content; FileNotFoundError when absent, JsonFileError when unparsable."""
        try:
            text = self.path.read_text("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonFileError(f"{self.path}: not UTF-8 text: {exc.reason}") from None
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise JsonFileError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            return loads(text)
        except RecursionError:
            raise JsonFileError(f"{self.path}: not valid JSON: nested too deeply") from None
        except ValueError as exc:
            raise JsonFileError(f"{self.path}: not valid JSON: {exc}") from None

    def read(self, default: T, *, expect: type | None = None) -> Any:
        """The content, or a copy of ``default`` when absent; corrupt content is moved aside.

        ``expect`` (e.g. ``list``) also treats a parsable file of another JSON type as
        corrupt. Takes the lock, so it never reads a file another process is rewriting
        through a path that is not atomic.
        """
        with self.lock():
            return self._read_locked(default, expect)

    def _read_locked(self, default: T, expect: type | None) -> Any:
        try:
            value = self.read_strict()
        except FileNotFoundError:
            return copy.deepcopy(default)
        except JsonFileError as exc:
            self._move_aside(str(exc))
            return copy.deepcopy(default)
        if expect is not None and not isinstance(value, expect):
            self._move_aside(f"{self.path}: expected a JSON {_json_type(expect)}, "
                             f"found {_json_type(type(value))}")
            return copy.deepcopy(default)
        return value

    # -- writing -----------------------------------------------------------------
    def write(self, value: Any) -> None:
        """Replace the content atomically (under the lock)."""
        with self.lock():
            self.write_locked(value)

    def update(self, mutate: Callable[[Any], Any], default: T, *,
               expect: type | None = None) -> Any:
        """Read, ``mutate(value) -> new value``, write back: one locked cycle.

        Returns what was written. ``mutate`` may change the value in place and
        return it.
        """
        with self.lock():
            value = self._read_locked(default, expect)
            new = mutate(value)
            self.write_locked(new)
            return new

    def write_locked(self, value: Any) -> None:
        """Replace the content atomically; the caller holds :meth:`lock`."""
        text = dumps(value)
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        _fsync_dir(folder)

    def _move_aside(self, problem: str) -> None:
        stamp = utc_now().strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.rename(self.path, target)
        _fsync_dir(self.path.parent)
        log.error("%s; moved aside to %s and started afresh", problem, target.name)
        if self._on_corrupt is not None:
            try:
                self._on_corrupt(CorruptFile(str(self.path), str(target), problem,
                                             utc_now().isoformat()))
            except Exception:
                log.exception("corrupt-file reporter failed")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json_type(kind: type) -> str:
    return {list: "array", dict: "object", str: "string", int: "number", float: "number",
            bool: "boolean", type(None): "null"}.get(kind, kind.__name__)
