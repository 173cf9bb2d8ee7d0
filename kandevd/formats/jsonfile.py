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
  A file that cannot be read now (no permission, no file descriptor left, an I/O
  error) is no corrupt file: :class:`JsonFileUnreadable` (an ``OSError``) is
  raised and the file left where it is, as a write that fails is.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from kandevd.formats import jsonstrict
from kandevd.fsutil import ensure_dir, fsync_dir, replace_atomically
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.jsonfile")

T = TypeVar("T")

#: How long a writer waits for another process's lock before giving up.
LOCK_TIMEOUT_S = 30.0


class JsonFileError(Exception):
    """A JSON file that cannot be read or written; the message names the path."""


class JsonFileUnreadable(JsonFileError, OSError):
    """The file is there but cannot be read now (permissions, resources, I/O): it is
    left alone, never moved aside; callers treat it as a failed write."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: cannot read: {why}")
        #: Why, in the system's words (``Permission denied``).
        self.why = why


@dataclass(frozen=True)
class CorruptFile:
    """A file that did not parse and was moved aside."""

    path: str
    moved_to: str
    error: str
    at: str


CorruptReporter = Callable[[CorruptFile], None]


class CorruptFiles:
    """The files moved aside lately, kept to be shown (``scheduler.errors``); a
    :data:`CorruptReporter` that any reader of the root's files is given. Thread-safe."""

    def __init__(self, keep: int = 100) -> None:
        self._lock = threading.Lock()
        self._keep = keep
        self._reports: list[CorruptFile] = []

    def __call__(self, report: CorruptFile) -> None:
        with self._lock:
            self._reports.append(report)
            del self._reports[:-self._keep]

    def recent(self) -> list[CorruptFile]:
        with self._lock:
            return list(self._reports)


def loads(text: str, *, unique_keys: bool = False) -> Any:
    """Strict JSON (see :mod:`kandevd.formats.jsonstrict`): what kandevd reads it can write back."""
    return jsonstrict.loads(text, unique_keys=unique_keys)


def dumps(value: Any, indent: int | None = 2) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=False) + "\n"


_MISS = object()

#: ``{id(item): (item, its JSON text)}`` for the items of a cached list.
ItemTexts = dict[int, tuple[Any, str]]


class _ParsedCache:
    """The last content of a few large list files, parsed and encoded item by item.

    Keyed by what ``stat`` says: every write renames a new file into place, so a
    write by anyone (this process or another) changes the inode and the cached
    value no longer matches. A value is *taken* out while an update mutates it, so
    no two users ever share one object. Item texts are reused for items that are
    the very same objects as last time, which is why the owner of a cached file
    must replace an item to change it, never mutate it in place.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[Path, tuple[tuple[int, int, int], Any, ItemTexts]] = \
            OrderedDict()

    def take(self, path: Path) -> tuple[Any, ItemTexts]:
        with self._lock:
            item = self._items.pop(path, None)
        if item is None or item[0] != stat_key(path):
            return _MISS, {}
        return item[1], item[2]

    def put(self, path: Path, value: Any, texts: ItemTexts) -> None:
        key = stat_key(path)
        if key is None:
            return
        with self._lock:
            self._items[path] = (key, value, texts)
            self._items.move_to_end(path)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


def stat_key(path: Path) -> tuple[int, int, int] | None:
    """``(inode, mtime_ns, size)``: changes whenever the file is replaced; None if absent."""
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size)


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def _encode_items(items: list[Any], previous: ItemTexts) -> tuple[str, ItemTexts]:
    """A list as JSON, one item per line, re-encoding only items not seen before."""
    texts: ItemTexts = {}
    parts = []
    for item in items:
        hit = previous.get(id(item))
        text = hit[1] if hit is not None and hit[0] is item else _ENCODER.encode(item)
        texts[id(item)] = (item, text)
        parts.append(text)
    return ("[\n" + ",\n".join(parts) + "\n]\n") if parts else "[]\n", texts


_CACHE = _ParsedCache(size=8)


class JsonFile:
    """One JSON file: atomic writes, a lock beside it, corrupt content moved aside."""

    def __init__(self, path: Path, *, on_corrupt: CorruptReporter | None = None,
                 indent: int | None = 2, cache: bool = False) -> None:
        """``indent`` None writes compact JSON. ``cache`` (for large, machine-kept
        lists such as run history) keeps the parsed and encoded content between
        updates, so recording into a large file neither parses nor re-encodes all of
        it; such a list is written one item per line, and its owner replaces an item
        to change it (see :class:`_ParsedCache`)."""
        self.path = Path(path)
        self._on_corrupt = on_corrupt
        self._indent = indent
        self._cache = cache

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def lock(self) -> FileLock:
        """The inter-process lock guarding this file (re-entrant within a thread)."""
        return FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S)

    # -- reading -----------------------------------------------------------------
    def read_strict(self, *, unique_keys: bool = False) -> Any:
        """The parsed content; FileNotFoundError when absent, JsonFileError when unparsable
        (JsonFileUnreadable when it cannot be read now). ``unique_keys``: a key given
        twice in one object is unparsable too (a file edited by hand)."""
        try:
            if not stat.S_ISREG(self.path.stat().st_mode):  # a FIFO would block the reader
                raise JsonFileError(f"{self.path}: not a regular file")
            text = self.path.read_text("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonFileError(f"{self.path}: not UTF-8 text: {exc.reason}") from None
        except FileNotFoundError:
            raise
        except IsADirectoryError as exc:
            raise JsonFileError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        except OSError as exc:
            raise JsonFileUnreadable(self.path, exc.strerror or str(exc)) from None
        try:
            return loads(text, unique_keys=unique_keys)
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
        except JsonFileUnreadable:
            raise  # (there, and maybe fine: nothing is moved or started afresh)
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
            if not self._cache:
                new = mutate(self._read_locked(default, expect))
                self.write_locked(new)
                return new
            value, texts = _CACHE.take(self.path)
            if value is _MISS:
                value = self._read_locked(default, expect)
            new = mutate(value)
            if isinstance(new, list):
                text, texts = _encode_items(new, texts)
                self._replace(text)
                _CACHE.put(self.path, new, texts)
            else:
                self.write_locked(new)
            return new

    def write_locked(self, value: Any) -> None:
        """Replace the content atomically; the caller holds :meth:`lock`."""
        self._replace(dumps(value, self._indent))

    def _replace(self, text: str) -> None:
        # Through a symbolic link, the file it points to is replaced (the link stays);
        # an existing file keeps its permission bits, a new one is private (0600).
        target = Path(os.path.realpath(self.path))
        ensure_dir(target.parent)  # every folder it creates is 0700, not only the last
        replace_atomically(target, text, durable=True, mode=None, unique_temp=True)

    def _move_aside(self, problem: str) -> None:
        stamp = utc_now().strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.rename(self.path, target)
        fsync_dir(self.path.parent)
        log.error("%s; moved aside to %s and started afresh", problem, target.name)
        if self._on_corrupt is not None:
            try:
                # (the report names the file apart: its reason without the path again)
                reason = problem.removeprefix(f"{self.path}: ")
                self._on_corrupt(CorruptFile(str(self.path), str(target), reason,
                                             utc_now().isoformat()))
            except Exception:
                log.exception("corrupt-file reporter failed")


def _json_type(kind: type) -> str:
    return {list: "array", dict: "object", str: "string", int: "number", float: "number",
            bool: "boolean", type(None): "null"}.get(kind, kind.__name__)
