"""Server-sent events: the overview's "something changed", and logs as they are written.

A stream holds one of the server's threads, so at most :data:`MAX_STREAMS`
are open at once (a further one is told to come back in 10 s, and its
browser does). Each ends when the console stops. The overview stream waits
for the daemon's events (a run queued, claimed, ended or cancelled), at most
one refresh every :data:`REFRESH_MIN_S`; a log stream looks at its file
twice a second and ends with the run. Both send a keep-alive comment every
:data:`KEEPALIVE_S`, so a closed tab frees its thread then at the latest. A
log event carries the file offset as its id: a reconnecting browser resumes
from ``Last-Event-ID`` and shows nothing twice.
"""

from __future__ import annotations

import codecs
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kandevd.control.protocol import RpcError
from kandevd.web.context import Console
from kandevd.web.http import Request, Response, stream, text
from kandevd.web.logs import safe_log_path
from kandevd.web.views.schedules import job_params

#: Below a browser's six connections per host, so pages still load beside the streams.
MAX_STREAMS = 4
REFRESH_MIN_S = 2.0
KEEPALIVE_S = 20.0
LOG_POLL_S = 0.5
STATUS_EVERY_S = 2.0
CHUNK = 64 * 1024
TERMINAL_RUNS = ("finished", "failed", "cancelled")

_slots = threading.BoundedSemaphore(MAX_STREAMS)


def _guarded(chunks: Callable[[], Iterator[bytes]]) -> Response:
    if not _slots.acquire(blocking=False):
        # A 200 the browser's EventSource reconnects after (a 503 would end it for good).
        return stream(iter([b"retry: 10000\n: too many live views are open\n\n"]))

    def run() -> Iterator[bytes]:
        try:
            yield b"retry: 3000\n\n"
            yield from chunks()
        finally:
            _slots.release()
    return stream(run())


def overview_events(console: Console, request: Request) -> Response:
    def chunks() -> Iterator[bytes]:
        changed = threading.Event()
        unsubscribe = console.subscribe(changed.set)
        try:
            while not console.stopping.is_set():
                if not changed.wait(KEEPALIVE_S):
                    yield b": keepalive\n\n"
                    continue
                if console.stopping.is_set():
                    return
                changed.clear()
                yield b"event: refresh\ndata: {}\n\n"
                console.stopping.wait(REFRESH_MIN_S)  # several changes, one refresh
        finally:
            unsubscribe()
    return _guarded(chunks)


def _event(name: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def follow(console: Console, path: Path | None, offset: int,
           finished: Callable[[], bool]) -> Iterator[bytes]:
    """Append events with what ``path`` gains after ``offset``, then ``end``.

    The text is decoded incrementally (a character split across two reads is
    sent whole, with the next one); each event's id is the offset after it."""
    checked = 0.0
    spoken = time.monotonic()
    done = False
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while not console.stopping.is_set():
        data = b""
        if path is not None:
            try:
                with open(path, "rb") as handle:
                    if os.fstat(handle.fileno()).st_size < offset:
                        offset = 0  # (rotated or replaced): from the start
                        decoder.reset()
                    handle.seek(offset)
                    data = handle.read(CHUNK)
            except OSError:
                data = b""
        if data:
            offset += len(data)
            textual = decoder.decode(data)
            if textual:
                spoken = time.monotonic()
                yield _event("append", {"text": textual, "offset": offset}, offset)
            continue
        if done:
            yield _event("end", {"offset": offset}, offset)
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


def run_log(console: Console, request: Request, run: str) -> Response:
    found = console.call("runs.get", {"id": run})
    path = safe_log_path(console, found.get("log_path") or
                         str(Path(console.home) / "logs" / "runs" / f"{run}.log"))
    offset = _offset(request)

    def finished() -> bool:
        try:
            return console.call("runs.get", {"id": run})["status"] in TERMINAL_RUNS
        except RpcError:
            return True
    return _guarded(lambda: follow(console, path, offset, finished))


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
    offset = _offset(request)

    def finished() -> bool:
        try:
            _entry, now = current()
        except RpcError:
            return True
        return now is None or now.get("status") != "running"
    return _guarded(lambda: follow(console, path, offset, finished))


def _offset(request: Request) -> int:
    """Where a log stream starts: a reconnecting browser's last event id, else ``from``."""
    for raw in (request.header("Last-Event-ID"), request.query.get("from")):
        try:
            if raw:
                return max(0, min(int(raw), 1 << 50))
        except ValueError:
            continue
    return 0
