"""``kandevd workspaces|agents|workflows|tasks|office ...``: the workspace model.

Each command maps its options onto one control method's params (an option's
destination *is* the param name, so an error about ``params.limit`` is shown
as ``--limit``). Tables and aligned fields by default, the raw result with
``--json``. ``kandevd methods NAME`` documents every param.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from kandevd.cli.common import FINITE, client_options, echo_json, invoke
from kandevd.cli.format import NONE, fields, json_option, shown, table
from kandevd.formats import jsonstrict

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
Render = Callable[[Any], None]

ACTIVE = click.Choice(["active", "paused"])
STYLE = click.Choice(["kanban", "office", "custom"])


def opt(*decls: str, dest: str, help: str, **kwargs: Any) -> Decorator:
    """An option whose destination is the method param it fills (default: not sent)."""
    if kwargs.get("type") is float:  # (nan and inf refused, naming the option)
        kwargs["type"] = FINITE
    return click.option(*decls, dest, default=None, help=help, **kwargs)


def paging() -> list[Decorator]:
    return [opt("--limit", dest="limit", type=int, help="Page size (1-500, default 50)."),
            opt("--offset", dest="offset", type=int, help="Rows to skip.")]


def show_fields(item: dict[str, Any]) -> None:
    fields(item.items())


def show_table(columns: Sequence[tuple[str, str]], noun: str) -> Render:
    def render(result: dict[str, Any]) -> None:
        table([title for title, _ in columns],
              [[shown(item.get(key)) for _, key in columns] for item in result["items"]])
        click.echo(f"{len(result['items'])} of {result['total']} {noun}(s)")
    return render


def model_command(group: click.Group, name: str, method: str, help_text: str,
                  options: Sequence[Decorator] = (), *, argument: str | None = None,
                  render: Render = show_fields,
                  prepare: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Add ``group name`` calling METHOD with the options given (None ones left out).

    ARGUMENT (if any) is a positional param (``id``); PREPARE may rewrite the
    params before the call (e.g. parse a JSON option).
    """
    def command(as_json: bool, home: str | None, socket_path: str | None,
                **values: Any) -> None:
        params = {k: v for k, v in values.items() if v is not None}
        if prepare is not None:
            prepare(params)
        result = invoke(home, socket_path, method, params)
        echo_json(result) if as_json else render(result)

    func: Callable[..., Any] = command
    for option in reversed([*options, json_option, client_options]):
        func = option(func)
    if argument is not None:
        func = click.argument(argument, metavar=argument.upper())(func)
    group.command(name, help=help_text)(func)


# -- workspaces -------------------------------------------------------------------------

@click.group()
def workspaces() -> None:
    """Manage workspaces (they hold agents, workflows and tasks)."""


model_command(workspaces, "list", "workspaces.list", "List workspaces.", paging(),
              render=show_table([("ID", "id"), ("NAME", "name"),
                                 ("OFFICE WORKFLOW", "office_workflow_id")], "workspace"))
model_command(workspaces, "get", "workspaces.get", "Show one workspace.", argument="id")
model_command(workspaces, "create", "workspaces.create", "Create a workspace.", [
    opt("--name", dest="name", required=True, help="Display name."),
    opt("--id", dest="id", help="Workspace id (generated when left out)."),
    opt("--office-workflow", dest="office_workflow_id", help="Workflow the office runs."),
])
model_command(workspaces, "update", "workspaces.update",
              "Change a workspace; only the options given are sent.", [
                  opt("--name", dest="name", help="New display name."),
                  opt("--office-workflow", dest="office_workflow_id",
                      help="Workflow the office runs ('' for none)."),
              ], argument="id")


# -- agents -----------------------------------------------------------------------------

@click.group()
def agents() -> None:
    """Manage the agents of a workspace (profile, cooldown, status)."""


model_command(agents, "list", "agents.list", "List agents, optionally of one workspace.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's agents."),
    opt("--status", dest="status", type=ACTIVE, help="Only agents in this status."),
    *paging(),
], render=show_table([("ID", "id"), ("WORKSPACE", "workspace_id"), ("NAME", "name"),
                      ("PROFILE", "profile"), ("COOLDOWN", "cooldown_s"),
                      ("STATUS", "status")], "agent"))
model_command(agents, "get", "agents.get", "Show one agent.", argument="id")


def runs_on_param(params: dict[str, Any]) -> None:
    """``--runs-on L`` (repeated): the labels a runner must carry; ``--here``: none."""
    labels, here = params.pop("runs_on", ()), params.pop("here", False)
    if labels and here:
        raise click.UsageError("--runs-on and --here exclude each other")
    if labels:
        params["runs_on"] = list(labels)
    elif here:
        params["runs_on"] = None  # (runs on the daemon's own machine again)


RUNS_ON = opt("--runs-on", dest="runs_on", multiple=True, metavar="LABEL",
              help="Run its runs only on a runner carrying this label (repeat for more; "
                   "docs/runners.md).")
model_command(agents, "create", "agents.create", "Create an agent in a workspace.", [
    opt("--workspace", dest="workspace_id", required=True, help="Workspace of the agent."),
    opt("--name", dest="name", required=True, help="Display name."),
    opt("--id", dest="id", help="Agent id (generated when left out)."),
    opt("--profile", dest="profile", help="Runtime profile (default 'default')."),
    opt("--cooldown", dest="cooldown_s", type=float, help="Seconds between runs."),
    opt("--status", dest="status", type=ACTIVE, help="Initial status (default active)."),
    RUNS_ON,
], prepare=runs_on_param)
model_command(agents, "update", "agents.update",
              "Change an agent; only the options given are sent.", [
                  opt("--profile", dest="profile", help="Runtime profile."),
                  opt("--cooldown", dest="cooldown_s", type=float,
                      help="Seconds between runs."),
                  opt("--status", dest="status", type=ACTIVE,
                      help="active, or paused (queued runs wait)."),
                  RUNS_ON,
                  click.option("--here", "here", is_flag=True, default=False,
                               help="Run its runs on the daemon's machine again "
                                    "(no runs_on)."),
              ], argument="id", prepare=runs_on_param)


# -- workflows --------------------------------------------------------------------------

def steps_param(params: dict[str, Any]) -> None:
    """``--steps-json`` or ``--from-file``: the steps list (or a workflow object)."""
    text, path = params.pop("steps", None), params.pop("from_file", None)
    if (text is None) == (path is None):
        raise click.UsageError("give the steps with either --steps-json or --from-file")
    hint = "--steps-json" if text is not None else "--from-file"
    if path is not None:
        try:
            with click.open_file(path) as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {path}: {exc}", param_hint=hint) from None
    try:
        value = jsonstrict.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=hint) from None
    if isinstance(value, dict):  # a whole workflow: its fields, the options override
        params.update({k: v for k, v in value.items() if k not in params})
        value = value.get("steps")
    if not isinstance(value, list):
        raise click.BadParameter("must be a JSON list of steps (or an object with 'steps')",
                                 param_hint=hint)
    params["steps"] = value
    for key, option in (("workspace_id", "--workspace"), ("name", "--name")):
        if key not in params:
            raise click.UsageError(f"missing {option} (or give it in {hint})")
    params.setdefault("style", "custom")


def show_workflow(workflow: dict[str, Any]) -> None:
    fields((k, v) for k, v in workflow.items() if k != "steps")
    table(("STEP", "NAME", "AGENT", "ON ENTER"),
          [(s["id"], s.get("name") or NONE, s.get("agent_id") or NONE,
            shown([a.get("action") for a in s.get("on_enter") or []]))
           for s in workflow.get("steps") or []])


@click.group()
def workflows() -> None:
    """Manage workflows: the ordered steps a task moves through."""


model_command(workflows, "list", "workflows.list", "List workflows.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's workflows."),
    opt("--style", dest="style", type=STYLE, help="Only workflows of this style."),
    *paging(),
], render=show_table([("ID", "id"), ("WORKSPACE", "workspace_id"), ("NAME", "name"),
                      ("STYLE", "style")], "workflow"))
model_command(workflows, "get", "workflows.get", "Show one workflow and its steps.",
              argument="id", render=show_workflow)
model_command(workflows, "create", "workflows.create", """Create a workflow.

Steps are structured, so they come as JSON: --steps-json '[{"id": "todo",
"name": "To do"}, {"id": "doing", "name": "Doing", "agent_id": "a1",
"on_enter": [{"action": "queue_run"}]}]', or --from-file FILE ('-' for stdin)
holding that list or a whole workflow object (its fields under the options).
""", [
    opt("--workspace", dest="workspace_id", help="Workspace of the workflow."),
    opt("--name", dest="name", help="Display name."),
    opt("--id", dest="id", help="Workflow id (generated when left out)."),
    opt("--style", dest="style", type=STYLE, help="kanban, office or custom (default custom)."),
    opt("--steps-json", dest="steps", help="The steps as a JSON list."),
    opt("--from-file", dest="from_file",
        type=click.Path(exists=True, dir_okay=False, allow_dash=True),
        help="JSON file with the steps list or a workflow object."),
], prepare=steps_param, render=show_workflow)


# -- tasks ------------------------------------------------------------------------------

def show_move(result: dict[str, Any]) -> None:
    task = result["task"]
    click.echo(f"{task['id']} -> {task['step_id']} (runner {task.get('runner') or NONE})")
    for action in result.get("actions") or []:
        detail = action.get("run_id") or action.get("skipped") or NONE
        dedup = " (deduplicated)" if action.get("deduplicated") else ""
        click.echo(f"{action.get('action')}: {detail}{dedup}")


@click.group()
def tasks() -> None:
    """Manage tasks: create, move between steps, launch."""


model_command(tasks, "list", "tasks.list", "List tasks, filtered and paged.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's tasks."),
    opt("--workflow", dest="workflow_id", help="Only this workflow's tasks."),
    opt("--step", dest="step_id", help="Only tasks in this step."),
    opt("--state", dest="state", help="Only tasks in this state (e.g. TODO)."),
    opt("--project", dest="project_id", help="Only this project's tasks."),
    opt("--runner", dest="runner", help="Only tasks this agent runs."),
    *paging(),
], render=show_table([("ID", "id"), ("WORKFLOW", "workflow_id"), ("STEP", "step_id"),
                      ("STATE", "state"), ("RUNNER", "runner"), ("TITLE", "title")], "task"))
model_command(tasks, "get", "tasks.get", "Show one task.", argument="id")
model_command(tasks, "create", "tasks.create", "Create a task in a workflow.", [
    opt("--workspace", dest="workspace_id", required=True, help="Workspace of the task."),
    opt("--workflow", dest="workflow_id", required=True, help="Workflow of the task."),
    opt("--title", dest="title", required=True, help="Title."),
    opt("--id", dest="id", help="Task id (generated when left out)."),
    opt("--step", dest="step_id", help="Initial step (default the first)."),
    opt("--project", dest="project_id", help="Project of the task."),
    opt("--state", dest="state", help="Initial state (default TODO)."),
    opt("--runner", dest="runner_agent_id", help="Agent that runs it."),
])
model_command(tasks, "update", "tasks.update",
              "Change a task; only the options given are sent.", [
                  opt("--title", dest="title", help="New title."),
                  opt("--state", dest="state", help="New state."),
                  opt("--runner", dest="runner_agent_id", help="Agent that runs it."),
                  opt("--project", dest="project_id", help="Project ('' for none)."),
              ], argument="id")
model_command(tasks, "move", "tasks.move",
              "Move a task to a step; prints its on_enter actions (queued runs).",
              [opt("--step", dest="step_id", required=True, help="Step to move it to.")],
              argument="id", render=show_move)
model_command(tasks, "launch", "tasks.launch",
              "Queue a run for a task now; prints the session id.",
              [opt("--prompt", dest="prompt", help="Prompt of the run.")],
              argument="id", render=lambda r: click.echo(r.get("session_id") or shown(r)))


# -- office -----------------------------------------------------------------------------

@click.group()
def office() -> None:
    """Manage a workspace's office: projects, routines, budgets."""


@office.group()
def projects() -> None:
    """Projects of a workspace (tasks can belong to one)."""


@office.group()
def routines() -> None:
    """Routines: a cron expression that runs an agent."""


@office.group()
def budgets() -> None:
    """Budgets: spending limits of a workspace or an agent."""


model_command(projects, "list", "office.projects.list", "List projects.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's projects."),
    *paging(),
], render=show_table([("ID", "id"), ("WORKSPACE", "workspace_id"), ("NAME", "name")],
                     "project"))
model_command(projects, "create", "office.projects.create", "Create a project.", [
    opt("--workspace", dest="workspace_id", required=True, help="Workspace of the project."),
    opt("--name", dest="name", required=True, help="Display name."),
    opt("--id", dest="id", help="Project id (generated when left out)."),
])

ROUTINE_FIELDS: list[Decorator] = [
    opt("--timezone", "--tz", dest="timezone", help="IANA zone of the cron (default UTC)."),
    opt("--payload", dest="payload", help="Payload of the runs, a JSON object."),
    opt("--status", dest="status", type=ACTIVE, help="active or paused."),
    opt("--concurrency", dest="concurrency_policy",
        type=click.Choice(["skip_if_active", "always_create"]),
        help="What a fire does while a run is active."),
    opt("--catch-up", dest="catch_up_policy",
        type=click.Choice(["skip_missed", "enqueue_missed_with_cap"]),
        help="What happens to fires missed while down."),
    opt("--catch-up-max", dest="catch_up_max", type=int, help="Cap of missed fires queued."),
]


def payload_param(params: dict[str, Any]) -> None:
    if "payload" in params:
        try:
            params["payload"] = jsonstrict.loads(params["payload"])
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--payload") from None


model_command(routines, "list", "office.routines.list", "List routines.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's routines."),
    opt("--agent", dest="agent_id", help="Only this agent's routines."),
    opt("--status", dest="status", type=ACTIVE, help="Only routines in this status."),
    *paging(),
], render=show_table([("ID", "id"), ("AGENT", "agent_id"), ("CRON", "cron_expression"),
                      ("TZ", "timezone"), ("STATUS", "status"), ("NAME", "name")], "routine"))
model_command(routines, "create", "office.routines.create", "Create a routine.", [
    opt("--workspace", dest="workspace_id", required=True, help="Workspace of the routine."),
    opt("--name", dest="name", required=True, help="Display name."),
    opt("--agent", dest="agent_id", required=True, help="Agent it runs."),
    opt("--cron", dest="cron_expression", required=True, help="Cron expression (5 fields)."),
    opt("--id", dest="id", help="Routine id (generated when left out)."),
    *ROUTINE_FIELDS,
], prepare=payload_param)
model_command(routines, "update", "office.routines.update",
              "Change a routine; only the options given are sent.", [
                  opt("--name", dest="name", help="Display name."),
                  opt("--agent", dest="agent_id", help="Agent it runs."),
                  opt("--cron", dest="cron_expression", help="Cron expression (5 fields)."),
                  *ROUTINE_FIELDS,
              ], argument="id", prepare=payload_param)

model_command(budgets, "list", "office.budgets.list", "List budgets.", [
    opt("--workspace", dest="workspace_id", help="Only this workspace's budgets."),
    opt("--scope-type", dest="scope_type", type=click.Choice(["agent", "workspace"]),
        help="Only budgets of this scope."),
    opt("--scope-id", dest="scope_id", help="Only budgets of this agent or workspace."),
    *paging(),
], render=show_table([("ID", "id"), ("SCOPE", "scope_type"), ("SCOPE ID", "scope_id"),
                      ("LIMIT CENTS", "limit_cents"), ("PERIOD", "period"),
                      ("ON EXCEED", "action_on_exceed")], "budget"))
model_command(budgets, "create", "office.budgets.create", "Create a budget.", [
    opt("--workspace", dest="workspace_id", required=True, help="Workspace of the budget."),
    opt("--scope-type", dest="scope_type", required=True,
        type=click.Choice(["agent", "workspace"]), help="What the budget limits."),
    opt("--scope-id", dest="scope_id", required=True, help="The agent or workspace id."),
    opt("--limit-cents", dest="limit_cents", required=True, type=float,
        help="Spending limit in cents."),
    opt("--period", dest="period", required=True, type=click.Choice(["monthly", "lifetime"]),
        help="Period of the limit."),
    opt("--id", dest="id", help="Budget id (generated when left out)."),
    opt("--alert-pct", dest="alert_threshold_pct", type=float,
        help="Alert at this percentage of the limit."),
    opt("--on-exceed", dest="action_on_exceed",
        type=click.Choice(["notify_only", "pause_agent"]), help="What exceeding it does."),
])

MODEL_GROUPS = (workspaces, agents, workflows, tasks, office)
