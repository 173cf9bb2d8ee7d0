"""``/runs``: the queue's runs filtered and paged (kept up to date while open), one run
(its attempts, where it is and why, its log followed live), cancel and retry, and the
dead letter (retry a selection, or every failed run the filter keeps)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from kandevd.control.protocol import RpcError
from kandevd.web.context import Console, parse_time, set_flash
from kandevd.web.http import Request, Response, redirect
from kandevd.web.logs import readable_log, run_log_path, run_stdout_path, with_output
from kandevd.web.views.schedules import _int

PAGE = 50
STATUSES = ("queued", "claimed", "finished", "failed", "cancelled")
FILTERS = ("status", "agent_id", "workspace_id", "reason")
_ATTEMPT = re.compile(r"^\[kandevd\] ==== attempt (?P<n>\d+) (?P<what>started|ended) "
                      r"(?P<at>\S+?)(?:: (?P<outcome>.*?))? ====$", re.M)


def _filters(source: dict[str, str], keys: tuple[str, ...] = FILTERS) -> dict[str, str]:
    """The filters given (a status only when it is one)."""
    kept = {}
    for key in keys:
        value = source.get(key, "").strip()
        if value and (key != "status" or value in STATUSES):
            kept[key] = value
    return kept


def _page(console: Console, request: Request) -> dict[str, Any]:
    filters = _filters(request.query)
    page = console.call("runs.list", {"order": "desc", "limit": PAGE,
                                      "offset": _int(request.query.get("offset")), **filters})
    now = datetime.now(UTC)
    for item in page["items"]:
        timing(item, now)
    query = {**filters, **({"offset": request.query["offset"]}
                           if request.query.get("offset") else {})}
    return {"page": page, "limit": PAGE, "fragment": "/fragments/runs" + (
        "?" + urlencode(query) if query else ""),
        "first_page": "/runs" + ("?" + urlencode(filters) if filters else "")}


def index(console: Console, request: Request) -> Response:
    status = request.query.get("status", "").strip()
    ignored = (f"There is no status {status!r}: runs of every status are shown."
               if status and status not in STATUSES else None)
    return console.render("runs.html", request, title="Runs", nav="runs",
                          filters={k: request.query.get(k, "") for k in FILTERS},
                          statuses=STATUSES, ignored=ignored, **_page(console, request))


def fragment(console: Console, request: Request) -> Response:
    """The list alone (the page's script swaps it in when a run changed)."""
    listed = Request({**request.environ, "PATH_INFO": "/runs"})  # (the pager's links)
    return console.fragment("runs_table.html", request=listed, **_page(console, request))


def timing(run: dict[str, Any], now: datetime) -> dict[str, Any]:
    """How long the run ran (``took_s``), runs (``running_s``) or waits (``waiting_s``)."""
    claimed = parse_time(run.get("claimed_at"))
    ended = parse_time(run.get("finished_at"))
    asked = parse_time(run.get("requested_at"))
    run["took_s"] = (ended - claimed).total_seconds() if claimed and ended else None
    run["running_s"] = (now - claimed).total_seconds() \
        if claimed and run.get("status") == "claimed" else None
    run["waiting_s"] = (now - asked).total_seconds() \
        if asked and run.get("status") == "queued" else None
    retry = parse_time(run.get("scheduled_retry_at"))
    # (a back-off still ahead of a queued run: the field keeps older ones as they were)
    run["retry_ahead"] = bool(retry and retry > now and run.get("status") == "queued")
    return run


DEAD_FILTERS = ("agent_id", "workspace_id", "reason")


def dead(console: Console, request: Request) -> Response:
    offset = _int(request.query.get("offset"))
    filters = _filters(request.query, DEAD_FILTERS)
    page = console.call("runs.list", {"status": "failed", "order": "desc", "limit": PAGE,
                                      "offset": offset, **filters})
    status = console.call("daemon.status")
    retention = ((status.get("store") or {}).get("db") or {}).get("retention_days")
    return console.render("dead.html", request, title="Dead letter", nav="dead", page=page,
                          limit=PAGE, filters={k: request.query.get(k, "")
                                               for k in DEAD_FILTERS},
                          kept=filters, retention_days=retention,
                          back=request.url(offset=None))


def _back(request: Request) -> str:
    back = request.form.get("back", "")
    return back if back.startswith("/runs/dead") and "//" not in back else "/runs/dead"


def _retry(console: Console, ids: list[str]) -> tuple[int, list[str]]:
    """``runs.retry`` each; how many went back to the queue, and why the others did not."""
    retried, problems = 0, []
    for run_id in ids:
        try:
            console.call("runs.retry", {"id": run_id})
            retried += 1
        except RpcError as exc:
            problems.append(f"{run_id}: {exc.message}")
    return retried, problems


def _said(retried: int, problems: list[str]) -> str:
    message = f"Retried {retried} run(s)"
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        message += f"; {len(problems)} not retried: " + "; ".join(problems[:5]) + more
    return message


def retry_selected(console: Console, request: Request) -> Response:
    chosen = list(dict.fromkeys(r for r in request.form_lists().get("run", []) if r))[:500]
    if not chosen:
        return set_flash(console, redirect(_back(request)), "error", "No run selected")
    retried, problems = _retry(console, chosen)
    return set_flash(console, redirect(_back(request)), "error" if problems else "ok",
                     _said(retried, problems))


def retry_all(console: Console, request: Request) -> Response:
    """Every failed run the filter keeps, not only one page: their ids first (oldest
    first, so runs failing meanwhile come after), then ``runs.retry`` each."""
    filters = _filters(request.form, DEAD_FILTERS)
    ids: list[str] = []
    seen: set[str] = set()
    offset = 0
    while True:
        page = console.call("runs.list", {"status": "failed", "order": "asc", "limit": 500,
                                          "offset": offset, **filters})
        for item in page["items"]:
            if item["id"] not in seen:
                seen.add(item["id"])
                ids.append(item["id"])
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            break
    if not ids:
        return set_flash(console, redirect(_back(request)), "error",
                         "No failed run matches: nothing retried")
    retried, problems = _retry(console, ids)
    return set_flash(console, redirect(_back(request)), "error" if problems else "ok",
                     _said(retried, problems) + " (every failed run the filter kept)")


def run(console: Console, request: Request, run: str) -> Response:
    found = console.call("runs.get", {"id": run})
    explanation = console.call("runs.explain", {"id": run})
    log = readable_log(console, run_log_path(console, found))
    attempts = attempts_of(log["text"])
    if found.get("status") == "claimed":  # its stdout joins the log when it ends
        log = with_output(log, run_stdout_path(console, run))
    timing(found, datetime.now(UTC))
    return console.render("run.html", request, title=f"Run {run}", nav="runs", run=found,
                          reasons=explain_in_words(explanation, found),
                          attempts=attempts, log=log)


def act(console: Console, request: Request, run: str, action: str) -> Response:
    result = console.call(f"runs.{action}", {"id": run})
    message = f"Cancelled run {run}" if action == "cancel" else \
        f"Queued run {run} again (status {result.get('status')})"
    return set_flash(console, redirect(f"/runs/{run}"), "ok", message)


def attempts_of(log_text: str) -> list[dict[str, Any]]:
    """The attempts the log frames (``==== attempt N started/ended ... ====``), in order:
    a run retried by ``runs.retry`` counts its attempts from 1 again, so an end belongs
    to the latest attempt of its number."""
    attempts: list[dict[str, Any]] = []
    for match in _ATTEMPT.finditer(log_text):
        number = int(match["n"])
        if match["what"] == "started":
            attempts.append({"number": number, "started_at": match["at"],
                             "ended_at": None, "outcome": None})
            continue
        latest = next((a for a in reversed(attempts) if a["number"] == number), None)
        if latest is not None and latest["ended_at"] is None:
            latest.update(ended_at=match["at"], outcome=match["outcome"])
    return attempts


def explain_in_words(explanation: dict[str, Any], run: dict[str, Any] | None = None
                     ) -> list[str]:
    """``runs.explain`` as sentences; a run that is not waiting says what happened."""
    if explanation.get("eligible"):
        return ["eligible: it is claimed on the next pass of the queue"]
    details = explanation.get("details") or {}
    words = []
    for blocker in explanation.get("blockers") or []:
        detail = details.get(blocker)
        if blocker.startswith("status_"):
            words.append(where_it_is(blocker[len("status_"):], run or {}))
        elif blocker == "agent_paused":
            words.append("waiting: its agent is paused")
        elif blocker == "agent_busy":
            words.append(f"waiting: agent busy with run {detail}" if detail
                         else "waiting: agent busy with another run")
        elif blocker == "cooldown_until":
            words.append(f"cooling down until {detail}")
        elif blocker == "retry_at":
            words.append(f"retry scheduled at {detail}")
        elif blocker == "queued_behind":
            words.append(f"waiting: queued behind run {detail} of the same agent")
        elif blocker == "runtime_full":
            words.append("waiting: every agent slot is in use")
        elif blocker == "budget_exceeded":
            words.append(f"waiting: budget exceeded ({detail})")
        else:
            words.append(f"{blocker}" + (f" ({detail})" if detail else ""))
    return words


def where_it_is(status: str, run: dict[str, Any]) -> str:
    """What happened to a run that is not waiting in the queue, in a sentence."""
    ended = run.get("finished_at")
    at = f" at {ended}" if ended else ""
    attempts = run.get("attempt")
    tries = f" after {attempts} attempt(s)" if attempts else ""
    if status == "finished":
        return f"finished{at}{tries}" + (f": {run['output_summary']}"
                                         if run.get("output_summary") else "")
    if status == "failed":
        error = f": {run['error_message']}" if run.get("error_message") else ""
        return f"failed for good{at}{tries}{error}; it is in the dead letter (Retry queues " \
            "it again)"
    if status == "cancelled":
        why = f": {run['cancel_reason']}" if run.get("cancel_reason") else ""
        return f"cancelled{at}{why}"
    if status == "claimed":
        since = f" since {run['claimed_at']}" if run.get("claimed_at") else ""
        return f"running{since}" + (f" (attempt {attempts})" if attempts else "")
    return f"{status}: not waiting in the queue"
