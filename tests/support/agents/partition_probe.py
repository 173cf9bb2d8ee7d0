"""A test agent that writes its own log of every execution, whatever the daemons believe.

Appends two lines to ``$PROBE_FILE`` (each under an exclusive lock): ``{"event":
"start", ...}`` when it starts and ``{"event": "end", ..., "terminated": bool}``
when it ends, with the run id, the agent, its pid, the home of the daemon that
started it (``KANDEVD_HOME``) and the time. It sleeps ``payload.sleep_s``
seconds (default 1), ends at SIGTERM (exit 143), unless ``payload.ignore_term``
(then only SIGKILL ends it, and no end line is written: its pid tells). From
that file alone one can tell whether a run ever had two executions at once,
across daemons.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time


def note(event: str, request: dict, **extra: object) -> None:
    line = json.dumps({"event": event, "run": request.get("run_id"),
                       "agent": request.get("agent_id"), "pid": os.getpid(),
                       "home": os.environ.get("KANDEVD_HOME"), "at": time.time(), **extra})
    with open(os.environ["PROBE_FILE"], "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(line + "\n")
        handle.flush()


def main() -> int:
    request = json.loads(sys.stdin.read())
    stopped = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = True

    payload = request.get("payload") or {}
    signal.signal(signal.SIGTERM, signal.SIG_IGN if payload.get("ignore_term") else on_term)
    note("start", request)
    deadline = time.time() + float(payload.get("sleep_s", 1))
    while not stopped and time.time() < deadline:
        time.sleep(0.02)
    note("end", request, terminated=stopped)
    print(json.dumps({"summary": "probed"}))
    return 143 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
