"""A test agent that proves who ran what, and when, independently of any daemon.

Appends ``{"run": ..., "agent": ..., "host_pid": ..., "start": t, "end": t}`` to the
file named by ``$PROBE_FILE`` (one line, written under an exclusive lock) after
sleeping ``payload.sleep_s`` seconds (default 0.05), or, with ``payload.wait_for``,
until that file exists. Several daemons' agents
write the same file, so the file alone tells whether a run executed twice and
whether one agent ever had two executions at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time


def main() -> int:
    request = json.loads(sys.stdin.read())
    start = time.time()
    payload = request.get("payload") or {}
    if payload.get("wait_for"):
        while not os.path.exists(payload["wait_for"]):
            time.sleep(0.05)
    else:
        time.sleep(float(payload.get("sleep_s", 0.05)))
    line = json.dumps({"run": request.get("run_id"), "agent": request.get("agent_id"),
                       "pid": os.getpid(), "start": start, "end": time.time()})
    with open(os.environ["PROBE_FILE"], "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(line + "\n")
    print(json.dumps({"summary": "probed"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
