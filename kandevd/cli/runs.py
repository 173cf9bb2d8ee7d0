"""``kandevd runs ...``: friendly wrappers over the ``runs.*`` methods."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from kandevd import exits
from kandevd.cli.common import client_options, connect, echo_json, error_line, invoke
from kandevd.cli.format import json_option, print_file_from, table
from kandevd.control.client import RpcCallError
from kandevd.control.protocol import MAX_DEPTH, MAX_LINE_BYTES, depth_exceeds
from kandevd.formats import jsonstrict
from kandevd.paths import HomeLayout, resolve_home
from kandevd.runs.model import STATUSES

#: How often ``runs logs --follow`` looks for more output (a log is a plain file).
FOLLOW_POLL_S = 0.5

COLUMNS = ("seq", "id", "status", "agent_id", "reason", "retry_count", "requested_at")


def print_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> None:
    table([c.upper() for c in columns],
          [["" if r.get(c) is None else str(r.get(c)) for c in columns] for r in rows])


def print_run(run: dict[str, Any]) -> None:
    for key, value in run.items():
        shown = json.dumps(value) if isinstance(value, (dict, list)) else value
        click.echo(f"{key:<20} {'' if shown is None else shown}")


@click.group()
def runs() -> None:
    """Inspect and control the global run queue."""


@runs.command("enqueue")
@click.option("--workspace", "workspace_id", default=None, help="Workspace id.")
@click.option("--agent", "agent_id", default=None, help="Agent id.")
@click.option("--reason", default=None, help="Why the run is requested.")
@click.option("--task", "task_id", default=None, help="Task id.")
@click.option("--payload", default="{}", help="Payload as a JSON object.")
@click.option("--key", "idempotency_key", default=None, help="Idempotency key.")
@click.option("--no-coalesce", is_flag=True, help="Never merge into a recent queued run.")
@click.option("--from-file", "from_file", type=click.File("rb"), default=None,
              help="Queue one run per line of this JSONL file (- for stdin); each line holds "
                   "runs.enqueue params.")
@json_option
@client_options
def enqueue(workspace_id: str | None, agent_id: str | None, reason: str | None,
            task_id: str | None, payload: str, idempotency_key: str | None, no_coalesce: bool,
            from_file: Any, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Queue a run for an agent (or one per line of --from-file)."""
    if from_file is not None:
        given = [name for name, value in (
            ("--workspace", workspace_id), ("--agent", agent_id), ("--reason", reason),
            ("--task", task_id), ("--key", idempotency_key)) if value]
        if given or payload != "{}" or no_coalesce:
            given += ["--payload"] if payload != "{}" else []
            given += ["--no-coalesce"] if no_coalesce else []
            raise click.UsageError(f"--from-file takes each run's params from its lines; "
                                   f"{', '.join(given)} cannot be given with it")
        _enqueue_lines(from_file, as_json, home, socket_path)
        return
    missing = [name for name, value in (("--workspace", workspace_id), ("--agent", agent_id),
                                        ("--reason", reason)) if not value]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or give --from-file)")
    try:
        payload_obj = jsonstrict.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--payload") from None
    if not isinstance(payload_obj, dict):
        raise click.BadParameter(f"must be a JSON object, not {json_type(payload_obj)}",
                                 param_hint="--payload")
    params: dict[str, Any] = {"workspace_id": workspace_id, "agent_id": agent_id,
                              "reason": reason, "payload": payload_obj,
                              "coalesce": not no_coalesce}
    if task_id:
        params["task_id"] = task_id
    if idempotency_key:
        params["idempotency_key"] = idempotency_key
    result = invoke(home, socket_path, "runs.enqueue", params)
    if as_json:
        echo_json(result)
        return
    note = " (deduplicated)" if result["deduplicated"] else (
        " (coalesced)" if result["coalesced"] else "")
    click.echo(f"{result['run']['id']} {result['run']['status']}{note}")


#: Lines sent per runs.enqueue_many request by ``runs enqueue --from-file``.
FROM_FILE_BATCH = 500
#: Most bytes of params one request carries: well inside the socket's 1 MiB line.
FROM_FILE_BATCH_BYTES = MAX_LINE_BYTES - 64 * 1024


def _read_lines(lines: Any) -> tuple[list[tuple[int, dict[str, Any], int]],
                                     list[tuple[int, str]]]:
    """``(requests, problems)``: each usable line as (number, params, encoded size).

    A line the daemon could not take (not UTF-8, not strict JSON, not an
    object, nested too deeply, too big for one request) is a problem of that
    line alone; blank lines are skipped.
    """
    requests: list[tuple[int, dict[str, Any], int]] = []
    problems: list[tuple[int, str]] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append((number, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                     f"column {exc.start + 1})"))
            continue
        try:
            params = jsonstrict.loads(text)
        except json.JSONDecodeError as exc:
            problems.append((number, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        except (ValueError, RecursionError) as exc:
            problems.append((number, f"not valid JSON: {exc}"))
            continue
        if not isinstance(params, dict):
            problems.append((number, f"not a JSON object but {json_type(params)}"))
            continue
        if depth_exceeds(params, MAX_DEPTH - 3):  # the request wraps it three levels deep
            problems.append((number, f"nested more than {MAX_DEPTH - 3} levels deep"))
            continue
        size = len(json.dumps(params)) + 1  # as the client encodes it, with its comma
        if size > FROM_FILE_BATCH_BYTES:
            problems.append((number, f"{size} bytes as a request: more than the "
                                     f"{FROM_FILE_BATCH_BYTES} one request can carry"))
            continue
        requests.append((number, params, size))
    return requests, problems


def _batches(requests: list[tuple[int, dict[str, Any], int]]
             ) -> list[list[tuple[int, dict[str, Any]]]]:
    """At most FROM_FILE_BATCH lines and FROM_FILE_BATCH_BYTES of params per batch."""
    batches: list[list[tuple[int, dict[str, Any]]]] = []
    current: list[tuple[int, dict[str, Any]]] = []
    size = 0
    for number, params, length in requests:
        if current and (len(current) >= FROM_FILE_BATCH
                        or size + length > FROM_FILE_BATCH_BYTES):
            batches.append(current)
            current, size = [], 0
        current.append((number, params))
        size += length
    if current:
        batches.append(current)
    return batches


def _enqueue_lines(lines: Any, as_json: bool, home: str | None,
                   socket_path: str | None) -> None:
    """Every non-empty line is a runs.enqueue params object; sent in batches, one connection.

    Each batch is one ``runs.enqueue_many`` (one transaction) of at most 500
    lines and well under the socket's 1 MiB line. Every line is answered:
    queued (``line N: <run id> <status>``; ``--json``: one object per line) or
    refused (``line N: why`` on stderr; ``--json``: ``{"line", "error"}`` on
    stdout). A line refused here (not UTF-8, not a JSON object, too big) or by
    the daemon (it names the item) does not stop the others: the rest of its
    batch is sent again without it. A progress bar goes to a terminal's
    stderr; a summary ends the output; the exit status is 1 if any line failed.
    """
    requests, problems = _read_lines(lines)
    counts = {"deduplicated": 0, "coalesced": 0, "failed": 0}
    total = len(requests) + len(problems)
    show_bar = sys.stderr.isatty() and not as_json and total > FROM_FILE_BATCH

    def refused(number: int, message: str, kind: str) -> None:
        counts["failed"] += 1
        if as_json:
            click.echo(json.dumps({"line": number, "error": {"message": message,
                                                             "kind": kind}}))
        else:
            if show_bar:
                click.echo("", err=True)  # off the progress bar's line
            click.echo(f"line {number}: {message} ({kind})", err=True)

    for number, message in problems:
        refused(number, message, "invalid_line")
    batches = _batches(requests)
    unsent: list[tuple[int, dict[str, Any]]] = []
    stopped: RpcCallError | None = None
    with connect(home, socket_path) as client, click.progressbar(
            length=len(requests), label="enqueueing", file=sys.stderr,
            hidden=not show_bar) as bar:
        for index, batch in enumerate(batches):
            try:
                accepted = _send_batch(client, batch, counts, refused)
            except RpcCallError as exc:  # not about one line: the daemon cannot take more
                stopped = exc
                unsent = [line for rest in batches[index:] for line in rest]
                break
            for number, result in accepted:
                if as_json:
                    click.echo(json.dumps({"line": number, **result}))
                elif not show_bar:
                    click.echo(f"line {number}: {result['run']['id']} {result['run']['status']}"
                               + _note(result))
            bar.update(len(batch))
    if stopped is not None:
        # A batch is all or nothing: nothing of the refused one (or after it) was stored.
        counts["failed"] += len(unsent)
        click.echo(f"kandevd: {stopped} ({stopped.kind or stopped.code}); lines "
                   f"{unsent[0][0]} to {unsent[-1][0]} were not queued", err=True)
    ok = total - counts["failed"]
    click.echo(f"{ok} of {total} queued ({counts['deduplicated']} deduplicated, "
               f"{counts['coalesced']} coalesced, {counts['failed']} failed)", err=True)
    if counts["failed"]:
        sys.exit(1)


def json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words (``null``, ``an array``, ``a number``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _note(result: dict[str, Any]) -> str:
    if result.get("deduplicated"):
        return " (deduplicated)"
    return " (coalesced)" if result.get("coalesced") else ""


def _send_batch(client: Any, batch: list[tuple[int, dict[str, Any]]], counts: dict[str, int],
                refused: Any) -> list[tuple[int, dict[str, Any]]]:
    """Send ``batch`` until it is accepted, dropping each line the daemon names as bad."""
    while batch:
        try:
            answer = client.call("runs.enqueue_many", {"runs": [p for _n, p in batch]})
        except RpcCallError as exc:
            index = (exc.error.get("data") or {}).get("index")
            if not isinstance(index, int) or not 0 <= index < len(batch):
                raise  # not about one line (e.g. the daemon is stopping): stop here
            message = re.sub(r"params\.runs\.\d+\.?", "", exc.args[0])  # the line says where
            refused(batch[index][0], message, exc.kind or str(exc.code))
            batch = batch[:index] + batch[index + 1:]
            continue
        results = answer["results"]
        for result in results:
            counts["deduplicated"] += bool(result["deduplicated"])
            counts["coalesced"] += bool(result["coalesced"])
        return [(number, result) for (number, _p), result in zip(batch, results, strict=True)]
    return []


@runs.command("list")
@click.option("--status", type=click.Choice(STATUSES), default=None,
              help="Only runs in this status.")
@click.option("--agent", "agent_id", default=None, help="Only this agent's runs.")
@click.option("--workspace", "workspace_id", default=None, help="Only this workspace's runs.")
@click.option("--task", "task_id", default=None, help="Only this task's runs.")
@click.option("--reason", default=None, help="Only runs requested for this reason.")
@click.option("--limit", type=int, default=50, show_default=True, help="Page size (max 500).")
@click.option("--offset", type=int, default=0, show_default=True, help="Rows to skip.")
@click.option("--order", type=click.Choice(["desc", "asc"]), default="desc", show_default=True,
              help="Newest first (desc) or in request order (asc).")
@json_option
@client_options
def list_runs(status: str | None, agent_id: str | None, workspace_id: str | None,
              task_id: str | None, reason: str | None, limit: int, offset: int, order: str,
              as_json: bool, home: str | None, socket_path: str | None) -> None:
    """List runs, newest first (--order asc: in request order)."""
    params = {k: v for k, v in {"status": status, "agent_id": agent_id,
                                "workspace_id": workspace_id, "task_id": task_id,
                                "reason": reason, "limit": limit, "offset": offset,
                                "order": order}.items() if v is not None}
    result = invoke(home, socket_path, "runs.list", params)
    if as_json:
        echo_json(result)
        return
    print_table(result["items"])
    click.echo(f"{len(result['items'])} of {result['total']} run(s)")


@runs.command("get")
@click.argument("run_id")
@json_option
@client_options
def get(run_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Show one run."""
    run = invoke(home, socket_path, "runs.get", {"id": run_id})
    echo_json(run) if as_json else print_run(run)


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", default=None, help="Why it is cancelled.")
@json_option
@client_options
def cancel(run_id: str, reason: str | None, as_json: bool, home: str | None,
           socket_path: str | None) -> None:
    """Cancel a queued or claimed run (a claimed run's agent is stopped)."""
    params: dict[str, Any] = {"id": run_id}
    if reason:
        params["reason"] = reason
    run = invoke(home, socket_path, "runs.cancel", params)
    echo_json(run) if as_json else click.echo(f"{run['id']} {run['status']}")


@runs.command("retry")
@click.argument("run_id")
@json_option
@client_options
def retry(run_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Queue a failed or cancelled run again, with a fresh attempt budget."""
    run = invoke(home, socket_path, "runs.retry", {"id": run_id})
    echo_json(run) if as_json else click.echo(f"{run['id']} {run['status']}")


@runs.command("logs")
@click.argument("run_id")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing what is appended until the run is finished, failed or "
                   "cancelled.")
@client_options
def logs(run_id: str, follow: bool, home: str | None, socket_path: str | None) -> None:
    """Print a run's log, each attempt framed by separator lines.

    A scheduled run (a session of a job) is not a queued run: `kandevd jobs logs
    JOB [ENTRY_ID]` prints its turns (a session id works as ENTRY_ID).
    """
    with connect(home, socket_path) as client:
        try:
            run = client.call("runs.get", {"id": run_id})
        except RpcCallError as exc:
            if exc.kind == "not_found":
                click.echo(f"kandevd: no run {run_id!r} (not_found). A scheduled job's "
                           "session is shown by `kandevd jobs logs JOB [ENTRY_ID]`; its "
                           "session id works as ENTRY_ID", err=True)
            else:
                click.echo(f"kandevd: {error_line(exc.error)}", err=True)
            sys.exit(exits.ERROR)
    path = Path(run["log_path"]) if run.get("log_path") else \
        HomeLayout(resolve_home(home)).run_logs / f"{run_id}.log"
    if not follow and not path.exists():  # (an empty answer would look like an empty log)
        click.echo(f"kandevd: run {run_id} has no log: no attempt of it has started "
                   f"(it is {run['status']})", err=True)
        return
    offset = 0
    while True:
        offset = print_file_from(path, offset)
        if not follow or run["status"] in ("finished", "failed", "cancelled"):
            if follow:
                print_file_from(path, offset)  # what the last attempt wrote as it ended
            return
        time.sleep(FOLLOW_POLL_S)
        run = invoke(home, socket_path, "runs.get", {"id": run_id})


@runs.command("explain")
@click.argument("run_id")
@json_option
@client_options
def explain(run_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Say why a queued run is not claimed yet."""
    result = invoke(home, socket_path, "runs.explain", {"id": run_id})
    if as_json:
        echo_json(result)
        return
    if result["eligible"]:
        click.echo("eligible: it will be claimed on the next pass")
        return
    for blocker in result["blockers"]:
        detail = result.get("details", {}).get(blocker)
        click.echo(f"blocked: {blocker}" + (f" ({detail})" if detail else ""))
