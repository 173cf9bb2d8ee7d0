"""Human output for the CLI: tables, aligned fields, instants in a zone, durations.

Shared by every friendly wrapper (``runs``, ``jobs``, ``scheduler``), so they
all print the same way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click

from kandevd.timeutil import parse_rfc3339, utc_now

NONE = "-"

#: Characters that would move the cursor or reorder what follows on a terminal: the
#: controls, and the bidirectional marks and overrides (a name could spoof a row).
_UNSAFE = {code for code in range(0x20)} | {0x7F} | set(range(0x80, 0xA0)) | {
    0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
_ESCAPED = {code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
            for code in _UNSAFE}


def printable(text: str) -> str:
    """``text`` with what a terminal would act on shown as an escape (``\\r`` as
    ``\\x0d``): a table's cells and a field's value are data, never control."""
    return text.translate(_ESCAPED) if any(ord(c) in _UNSAFE for c in text) else text


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    """Columns padded to their widest cell; the last column is never padded. Cells are
    :func:`printable`."""
    cells = [[printable(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def fields(pairs: Iterable[tuple[str, Any]]) -> None:
    """``key  value`` lines with the keys aligned; lists comma-joined, objects as JSON."""
    items = list(pairs)
    width = max((len(k) for k, _ in items), default=0)
    for key, value in items:
        click.echo(f"{key:<{width}}  {printable(shown(value))}".rstrip())


def shown(value: Any) -> str:
    if value is None or value == "":
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(shown(v) for v in value) or NONE
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def one_line(text: str, width: int | None = None) -> str:
    flat = " ".join(str(text).split())
    if width is not None and len(flat) > width:
        return flat[:width - 1] + "…"
    return flat


def zone(name: str | None) -> tzinfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return UTC


def span(seconds: int) -> str:
    """``3h 12m``: the two largest units of a non-negative number of seconds."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return " ".join(parts[:2])


def relative(moment: datetime, now: datetime | None = None) -> str:
    """``in 3h 12m`` / ``5m 2s ago`` / ``now``."""
    seconds = int((moment - (now or utc_now())).total_seconds())
    if seconds == 0:
        return "now"
    return f"in {span(seconds)}" if seconds > 0 else f"{span(-seconds)} ago"


def when(stamp: str | None, zone_name: str | None = "UTC", *, with_relative: bool = True,
         now: datetime | None = None) -> str:
    """An RFC 3339 instant as wall time in ``zone_name``, plus how far it is from now."""
    if not stamp:
        return NONE
    try:
        moment = parse_rfc3339(stamp)
    except ValueError:
        return stamp
    local = moment.astimezone(zone(zone_name)).strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"{local} ({relative(moment, now)})" if with_relative else local


def duration(ms: int | float | None) -> str:
    if ms is None:
        return NONE
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    return span(int(seconds))


def queue_line(runs: dict[str, Any], now: datetime | None = None) -> str:
    """``daemon.status.runs`` in one line: the queued runs ready to claim (and how long
    the oldest has waited) apart from those waiting for a retry back-off."""
    queued, retrying = runs.get("queued", 0), runs.get("retrying", 0)
    waits = []
    if retrying:
        ready = queued - retrying
        waits.append(f"{ready} ready" if ready > 0 else "none ready")
    if runs.get("oldest_queued_at"):
        age = ((now or utc_now()) - parse_rfc3339(runs["oldest_queued_at"])).total_seconds()
        waits.append(f"oldest waiting {max(age, 0):.0f}s")
    said = ", ".join(waits)
    if retrying:
        said += f"; {retrying} retrying after a back-off"
    return (f"{queued} queued" + (f" ({said})" if said else "") +
            f", {runs.get('claimed', 0)} claimed, {runs.get('failed', 0)} failed (dead "
            f"letter), {runs.get('finished', 0)} finished")


def json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print the raw JSON result.")(func)


def print_file_from(path: Path, offset: int) -> int:
    """Print ``path`` from byte ``offset``; the new offset (a missing file prints nothing).

    How ``runs logs`` and ``jobs logs`` show a log, and follow it as it grows."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return offset
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()
    return offset + len(data)
