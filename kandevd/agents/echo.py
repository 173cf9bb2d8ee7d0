"""The built-in demo agent: ``python -m kandevd.agents.echo``.

It speaks the agent process protocol (docs/agents.md) and does no real
work, so a fresh install, the demo home and the tests can drive every path of
the daemon (success, failure, retry, timeout, cancel) without an AI model.

Input: one JSON object on stdin. Options are read from ``payload`` and, on
top of it, from ``execution_options`` (how workflow turns carry them):

=================  ========================================================
``sleep_s``        sleep that long (SIGTERM interrupts it: exit 143)
``wait_for``       a path: wait until it exists (a run as long as a test needs)
``fail``           true: exit 1 with a message on stderr
``exit_code``      exit with this code (0..255)
``fail_once_marker``  a path: when it does not exist, create it and exit 1;
                   when it does, succeed (proves that retries happen)
``ignore_sigterm`` true: ignore SIGTERM (proves the SIGKILL escalation)
``cost_cents``     the cost to report (default 0)
``summary``        the summary to report (default ``echoed <kind>``)
``evaluation``     an object to report as the execution's evaluation
``touch``          a path: after a successful run append one line
                   ``<run_id or session_id> <start> <end>`` (RFC 3339)
=================  ========================================================

Output: ``echo: <kind> <id>``, a line with the ``KANDEVD_*`` environment, and
as the last line ``{"summary": ..., "cost_cents": ...}`` (with ``evaluation``
when given). Bad stdin (not JSON, not an object, an option of the wrong type)
is reported on stderr, exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from kandevd.fsutil import append_line
from kandevd.timeutil import rfc3339, utc_now

EXIT_USAGE = 2
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143, the shell's convention

def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_OPTION_TYPES: dict[str, tuple[str, Any]] = {
    "sleep_s": ("a non-negative number", lambda v: _is_number(v) and v >= 0),
    "fail": ("a boolean", lambda v: isinstance(v, bool)),
    "exit_code": ("an integer 0..255",
                  lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255),
    "fail_once_marker": ("a non-empty string path", lambda v: isinstance(v, str) and v != ""),
    "ignore_sigterm": ("a boolean", lambda v: isinstance(v, bool)),
    "cost_cents": ("a number", lambda v: _is_number(v)),
    "summary": ("a string", lambda v: isinstance(v, str)),
    "touch": ("a non-empty string path", lambda v: isinstance(v, str) and v != ""),
    "wait_for": ("a non-empty string path", lambda v: isinstance(v, str) and v != ""),
    "evaluation": ("an object", lambda v: isinstance(v, dict)),
}


class UsageError(Exception):
    """The input is not something the echo agent can act on (exit 2)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Exit like a shell-run program would, so logs show "exit code 143".
    sys.stderr.write("echo: terminated by SIGTERM\n")
    raise SystemExit(EXIT_SIGTERM)


def parse_request(raw: str) -> dict[str, Any]:
    """The stdin object; UsageError when it is not a JSON object."""
    try:
        request = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"stdin is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise UsageError(f"stdin must be a JSON object, got {type(request).__name__}")
    return request


def options_of(request: dict[str, Any]) -> dict[str, Any]:
    """Merged, type-checked options: ``payload`` then ``execution_options``."""
    options: dict[str, Any] = {}
    for source in ("payload", "execution_options"):
        value = request.get(source)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UsageError(f"{source} must be a JSON object, got {type(value).__name__}")
        options.update(value)
    for name, (expected, check) in _OPTION_TYPES.items():
        if name in options and options[name] is not None and not check(options[name]):
            raise UsageError(f"option {name} must be {expected}, got {options[name]!r}")
    return options


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, line.removesuffix("\n"))


def _first_time(marker: Path) -> bool:
    """Create ``marker``; True when this call created it (the failing run)."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(marker, "x", encoding="utf-8") as handle:
            handle.write(f"failed once at {rfc3339(utc_now())}\n")
    except FileExistsError:
        return False
    return True


def run(request: dict[str, Any]) -> int:
    """Act on a parsed request; returns the exit code."""
    options = options_of(request)
    if options.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = utc_now()
    kind = str(request.get("kind", "?"))
    ident = str(request.get("run_id") or request.get("session_id") or "")
    print(f"echo: {kind} {ident}", flush=True)
    env = " ".join(f"{name}={os.environ.get(name, '')}"
                   for name in ("KANDEVD_RUN_ID", "KANDEVD_SESSION_ID", "KANDEVD_HOME"))
    print(f"echo: env {env}", flush=True)
    if isinstance(request.get("message"), str):
        print(f"echo: message {json.dumps(request['message'])}", flush=True)

    sleep_s = options.get("sleep_s")
    if sleep_s:
        time.sleep(float(sleep_s))
    wait_for = options.get("wait_for")
    if wait_for:
        while not Path(wait_for).exists():
            time.sleep(0.05)

    marker = options.get("fail_once_marker")
    if marker and _first_time(Path(marker)):
        print(f"echo: failing once (created {marker})", file=sys.stderr, flush=True)
        return 1
    if options.get("fail"):
        print("echo: failing as asked (fail: true)", file=sys.stderr, flush=True)
        return 1
    exit_code = options.get("exit_code")
    if exit_code:
        print(f"echo: exiting {exit_code} as asked", file=sys.stderr, flush=True)
        return int(exit_code)

    touch = options.get("touch")
    if touch:
        _append_line(Path(touch), f"{ident} {rfc3339(started)} {rfc3339(utc_now())}\n")
    summary = options.get("summary")
    cost = options.get("cost_cents")
    report: dict[str, Any] = {
        "summary": summary if summary is not None else f"echoed {kind}",
        "cost_cents": cost if cost is not None else 0,
    }
    if options.get("evaluation") is not None:
        report["evaluation"] = options["evaluation"]
    print(json.dumps(report), flush=True)
    return 0


def main() -> int:
    """Entry point: read stdin, run, map usage errors to exit 2."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run(parse_request(sys.stdin.read()))
    except UsageError as exc:
        print(f"echo: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
