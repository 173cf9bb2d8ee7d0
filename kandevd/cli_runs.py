"""``kandevd runs ...``: friendly wrappers over the ``runs.*`` methods."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from kandevd.cli_common import client_options, connect, echo_json, invoke
from kandevd.cli_format import table
from kandevd.control.client import RpcCallError
from kandevd.paths import HomeLayout, resolve_home
from kandevd.store.runs import STATUSES

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
@click.option("--from-file", "from_file", type=click.File("r", encoding="utf-8"), default=None,
              help="Queue one run per line of this JSONL file (- for stdin); each line holds "
                   "runs.enqueue params.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@client_options
def enqueue(workspace_id: str | None, agent_id: str | None, reason: str | None,
            task_id: str | None, payload: str, idempotency_key: str | None, no_coalesce: bool,
            from_file: Any, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Queue a run for an agent (or one per line of --from-file)."""
    if from_file is not None:
        _enqueue_lines(from_file, as_json, home, socket_path)
        return
    missing = [name for name, value in (("--workspace", workspace_id), ("--agent", agent_id),
                                        ("--reason", reason)) if not value]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or give --from-file)")
    try:
        payload_obj = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--payload") from None
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


def _enqueue_lines(lines: Any, as_json: bool, home: str | None,
                   socket_path: str | None) -> None:
    """Every non-empty line is a runs.enqueue params object; batches of 500, one connection.

    Each batch is one ``runs.enqueue_many`` (one transaction). A line the daemon
    refuses is reported (``line N: why``) and the rest of its batch is sent
    again without it, so a bad line does not stop the others; the exit status
    is 1 if any failed. Each queued line is printed (``line N: <run id>
    <status>``; ``--json``: one object per line); a progress bar goes to a
    terminal's stderr; a summary ends the output.
    """
    requests: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            params = json.loads(line)
        except ValueError as exc:
            raise click.BadParameter(f"line {number}: not valid JSON: {exc}",
                                     param_hint="--from-file") from None
        if not isinstance(params, dict):
            raise click.BadParameter(f"line {number}: not a JSON object",
                                     param_hint="--from-file")
        requests.append((number, params))
    counts = {"queued": 0, "deduplicated": 0, "coalesced": 0, "failed": 0}
    show_bar = sys.stderr.isatty() and not as_json and len(requests) > FROM_FILE_BATCH
    sent = 0
    stopped: RpcCallError | None = None
    with connect(home, socket_path) as client, click.progressbar(
            length=len(requests), label="enqueueing", file=sys.stderr,
            hidden=not show_bar) as bar:
        for start in range(0, len(requests), FROM_FILE_BATCH):
            batch = requests[start:start + FROM_FILE_BATCH]
            failed_before = counts["failed"]
            try:
                accepted = _send_batch(client, batch, counts)
            except RpcCallError as exc:  # not about one line: the daemon cannot take more
                stopped = exc
                counts["failed"] = failed_before  # the whole batch is counted below
                break
            sent += len(batch)
            for number, result in accepted:
                if as_json:
                    click.echo(json.dumps({"line": number, **result}))
                elif not show_bar:
                    click.echo(f"line {number}: {result['run']['id']} {result['run']['status']}"
                               + _note(result))
            bar.update(len(batch))
    if stopped is not None:
        # Nothing of the refused batch was stored (a batch is all or nothing).
        counts["failed"] += len(requests) - sent
        click.echo(f"kandevd: stopped at line {requests[sent][0]}: {stopped} "
                   f"({stopped.kind or stopped.code}); lines from there on were not queued",
                   err=True)
    ok = len(requests) - counts["failed"]
    click.echo(f"{ok} of {len(requests)} queued ({counts['deduplicated']} deduplicated, "
               f"{counts['coalesced']} coalesced, {counts['failed']} failed)", err=True)
    if counts["failed"]:
        sys.exit(1)


def _note(result: dict[str, Any]) -> str:
    if result.get("deduplicated"):
        return " (deduplicated)"
    return " (coalesced)" if result.get("coalesced") else ""


def _send_batch(client: Any, batch: list[tuple[int, dict[str, Any]]],
                counts: dict[str, int]) -> list[tuple[int, dict[str, Any]]]:
    """Send ``batch`` until it is accepted, dropping each line the daemon names as bad."""
    while batch:
        try:
            answer = client.call("runs.enqueue_many", {"runs": [p for _n, p in batch]})
        except RpcCallError as exc:
            index = (exc.error.get("data") or {}).get("index")
            if not isinstance(index, int) or not 0 <= index < len(batch):
                raise  # not about one line (e.g. the daemon is stopping): stop here
            number = batch[index][0]
            message = re.sub(r"params\.runs\.\d+\.?", "", exc.args[0])  # the line says where
            click.echo(f"line {number}: {message} ({exc.kind or exc.code})", err=True)
            counts["failed"] += 1
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
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
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
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@client_options
def get(run_id: str, as_json: bool, home: str | None, socket_path: str | None) -> None:
    """Show one run."""
    run = invoke(home, socket_path, "runs.get", {"id": run_id})
    echo_json(run) if as_json else print_run(run)


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", default=None, help="Why it is cancelled.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
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
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
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
    """Print a run's log, each attempt framed by separator lines."""
    run = invoke(home, socket_path, "runs.get", {"id": run_id})
    path = Path(run["log_path"]) if run.get("log_path") else \
        HomeLayout(resolve_home(home)).run_logs / f"{run_id}.log"
    offset = 0
    while True:
        offset = _print_from(path, offset)
        if not follow or run["status"] in ("finished", "failed", "cancelled"):
            if follow:
                _print_from(path, offset)  # what the last attempt wrote as it ended
            return
        time.sleep(FOLLOW_POLL_S)
        run = invoke(home, socket_path, "runs.get", {"id": run_id})


def _print_from(path: Path, offset: int) -> int:
    """Print ``path`` from byte ``offset``; the new offset (a missing file prints nothing)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()
    return offset + len(data)


@runs.command("explain")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
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
