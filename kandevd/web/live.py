"""Server-sent events: the overview's "something changed", and logs as they are written.

A stream holds one of the server's threads, so at most :data:`MAX_STREAMS`
are open at once: a further one gets a ``busy`` event and is told to come
back in :data:`BUSY_RETRY_S` (its browser does, and shows that the view is
waiting), and an accepted one starts with a ``ready`` event (the page takes
the notice away). Each ends when the console stops. The overview stream waits
for the daemon's events (a run queued, claimed, ended or cancelled), at most
one refresh every :data:`REFRESH_MIN_S`; a log stream looks at its file
(and the agent's stdout, which joins the log's end when the execution ends)
twice a second and ends with the run. A page going away says so (``POST
/events/leave`` with the ids its ``ready`` events carried, sent by the browser
as the page is hidden), and its streams end at once: a stream's thread only
learns that its reader is gone when it next writes, so quick navigation would
otherwise find every slot held by pages already left. Both send a keep-alive
comment every :data:`KEEPALIVE_S`, so a tab that could not say it left (a
crashed browser, a lost network) frees its thread then at the latest. A log
event carries the files' offsets as its id: a reconnecting browser resumes
from ``Last-Event-ID`` and shows nothing twice.
"""

from __future__ import annotations

import codecs
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kandevd.control.protocol import RpcError
from kandevd.web.context import Console
from kandevd.web.http import Request, Response, stream, text
from kandevd.web.logs import run_log_path, run_stdout_path, safe_log_path, turn_stdout_path
from kandevd.web.views.schedules import job_params

#: Below a browser's six connections per host, so pages still load beside the streams.
MAX_STREAMS = 4
REFRESH_MIN_S = 2.0
KEEPALIVE_S = 20.0
LOG_POLL_S = 0.5
STATUS_EVERY_S = 2.0
#: A refused stream's browser tries again after this long.
BUSY_RETRY_S = 10
CHUNK = 64 * 1024
TERMINAL_RUNS = ("finished", "failed", "cancelled")
#: What the overview is refreshed for (the topics of ``events.subscribe``).
OVERVIEW_TOPICS = ("run.*", "schedule.*")

#: Most stream ids one ``POST /events/leave`` names (a page holds one or two).
MAX_LEAVING = 8

_slots = threading.BoundedSemaphore(MAX_STREAMS)


class Stream:
    """One accepted live view: its id (sent in its ``ready`` event) and whether its page
    has left (:func:`leave`); what waits for events is woken by ``on_leave``."""

    def __init__(self) -> None:
        self.id = secrets.token_urlsafe(16)
        self.left = threading.Event()
        self._on_leave: list[Callable[[], None]] = []

    def on_leave(self, action: Callable[[], None]) -> None:
        """Call ``action`` when the page leaves (at once if it has; it may run twice)."""
        self._on_leave.append(action)
        if self.left.is_set():
            action()

    def leave(self) -> None:
        self.left.set()
        for action in list(self._on_leave):
            action()


_open: dict[str, Stream] = {}
_open_lock = threading.Lock()


def _guarded(chunks: Callable[[Stream], Iterator[bytes]]) -> Response:
    if not _slots.acquire(blocking=False):
        # A 200 the browser's EventSource reconnects after (a 503 would end it for good).
        busy = _event("busy", {"open": MAX_STREAMS, "retry_s": BUSY_RETRY_S})
        return stream(iter([f"retry: {BUSY_RETRY_S * 1000}\n".encode() + busy]))

    def run() -> Iterator[bytes]:
        accepted = Stream()
        with _open_lock:
            _open[accepted.id] = accepted
        try:
            yield b"retry: 3000\n" + _event("ready", {"id": accepted.id})
            yield from chunks(accepted)
        finally:
            with _open_lock:
                _open.pop(accepted.id, None)
            _slots.release()
    return stream(run())


def leave(console: Console, request: Request) -> Response:
    """``POST /events/leave`` (``streams``: ids, comma-separated): a page going away ends
    its live views now, so their slots are free for the next page (204 either way)."""
    ids = request.form.get("streams", "").split(",")[:MAX_LEAVING]
    with _open_lock:
        leaving = [_open[i] for i in ids if i in _open]
    for found in leaving:
        found.leave()
    return Response(b"", 204, content_type="text/plain; charset=utf-8")


def overview_events(console: Console, request: Request) -> Response:
    def chunks(accepted: Stream) -> Iterator[bytes]:
        events = console.subscribe(OVERVIEW_TOPICS)
        accepted.on_leave(lambda: console.unsubscribe(events))  # (wakes the wait below)
        try:
            while not console.stopping.is_set() and not events.closed:
                changed = events.take(KEEPALIVE_S)
                if console.stopping.is_set() or events.closed:
                    return
                if not changed:
                    yield b": keepalive\n\n"
                    continue
                yield b"event: refresh\ndata: {}\n\n"
                console.stopping.wait(REFRESH_MIN_S)  # several changes, one refresh
        finally:
            console.unsubscribe(events)
    return _guarded(chunks)


def _event(name: str, data: Any, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@dataclass
class Part:
    """One file a live log shows: the log itself, or the agent's stdout (found again at
    each read: a new attempt has a new file)."""

    name: str
    locate: Callable[[], Path | None]
    offset: int = 0
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(
        "replace"))
    seen: Path | None = None

    def read(self) -> bytes | None:
        """What the file gained (b"" for nothing); None when the stdout file this part
        followed is gone or another one (merged into the log, or a new attempt)."""
        path = self.locate()
        if self.seen is not None and path != self.seen:
            return None
        if path is None:
            return b""
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size < self.offset:
                    self.offset = 0  # (rotated or replaced): from the start
                    self.decoder.reset()
                handle.seek(self.offset)
                data = handle.read(CHUNK)
        except OSError:
            return None if self.seen is not None else b""
        if self.name != "log":
            self.seen = path
        return data


def follow(console: Console, parts: list[Part], finished: Callable[[], bool],
           accepted: Stream | None = None) -> Iterator[bytes]:
    """``append`` events with what each part's file gains after its offset, then ``end``
    (also when a stdout file followed went: the page reloads with the whole log).

    The stdout part is read before the log, so text merged from it into the log is
    never sent twice. Text is decoded incrementally (a character split across two
    reads is sent whole, with the next one); an event's id is every part's offset
    (``log.stdout``), from which a reconnecting browser resumes. It ends quietly
    once ``accepted``'s page has left."""
    checked = 0.0
    spoken = time.monotonic()
    done = False
    ordered = sorted(parts, key=lambda part: part.name == "log")  # (stdout first)
    while not console.stopping.is_set():
        if accepted is not None and accepted.left.is_set():
            return
        sent = False
        for part in ordered:
            data = part.read()
            if data is None:
                yield _event("end", {"part": part.name}, _ids(parts))
                return
            if not data:
                continue
            part.offset += len(data)
            textual = part.decoder.decode(data)
            if textual:
                sent = True
                spoken = time.monotonic()
                yield _event("append", {"text": textual, "part": part.name,
                                        "offset": part.offset}, _ids(parts))
        if sent:
            continue
        if done:
            yield _event("end", {}, _ids(parts))
            return
        now = time.monotonic()
        if now - spoken >= KEEPALIVE_S:
            spoken = now
            yield b": keepalive\n\n"  # (a closed tab makes this write fail: the end)
        if now - checked >= STATUS_EVERY_S:
            checked = now
            done = finished()  # one more read after it ended: what it wrote last
            if done:
                continue
        console.stopping.wait(LOG_POLL_S)


def _ids(parts: list[Part]) -> str:
    return ".".join(str(part.offset) for part in parts)


def run_log(console: Console, request: Request, run: str) -> Response:
    found = console.call("runs.get", {"id": run})
    path = safe_log_path(console, run_log_path(console, found))
    log_at, out_at = _offsets(request)

    def finished() -> bool:
        try:
            return console.call("runs.get", {"id": run})["status"] in TERMINAL_RUNS
        except RpcError:
            return True
    parts = [Part("log", lambda: path, log_at),
             Part("stdout", lambda: run_stdout_path(console, run), out_at)]
    return _guarded(lambda accepted: follow(console, parts, finished, accepted))


def turn_log(console: Console, request: Request, job: str, entry: str, index: str
             ) -> Response:
    params = job_params(job, request)
    turn_at = int(index)

    def current() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        page = console.call("scheduler.jobs.runs", {**params, "limit": 500})
        for item in page["items"]:
            if item.get("id") == entry:
                turns = [t for t in item.get("turns") or [] if isinstance(t, dict)]
                turn = next((t for t in turns if t.get("index") == turn_at), None)
                return item, turn
        return None, None

    item, turn = current()
    if item is None or turn is None:
        return text("no such turn", 404)
    path = safe_log_path(console, turn.get("log_path"))
    log_at, out_at = _offsets(request)

    def finished() -> bool:
        try:
            _entry, now = current()
        except RpcError:
            return True
        return now is None or now.get("status") != "running"
    parts = [Part("log", lambda: path, log_at),
             Part("stdout", lambda: turn_stdout_path(console, entry, turn_at), out_at)]
    return _guarded(lambda accepted: follow(console, parts, finished, accepted))


def _offsets(request: Request) -> tuple[int, int]:
    """Where a log stream starts in the log and in the stdout file: a reconnecting
    browser's last event id (``log.stdout``), else ``from`` and ``out``."""
    last = (request.header("Last-Event-ID") or "").split(".")
    if len(last) == 2 and all(p.isdigit() and len(p) < 16 for p in last):
        return int(last[0]), int(last[1])
    return _number(request.query.get("from")), _number(request.query.get("out"))


def _number(raw: str | None) -> int:
    try:
        return max(0, min(int(raw or 0), 1 << 50))
    except ValueError:
        return 0
