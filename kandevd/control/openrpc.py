"""``rpc.discover``: the registry as an OpenRPC document.

The document is built from each method's own params JSON Schema, so it cannot
drift from what the daemon checks. :mod:`kandevd.control.reference` renders
the same data as docs/protocol.md's method reference.
"""

from __future__ import annotations

from typing import Any

from kandevd import __version__
from kandevd.control.registry import Method, Registry

OPENRPC_VERSION = "1.2.6"

# One line per method where its module gives none (registry.add(summary=...) wins).
# Results have no schema: OpenRPC's result is {"name": "result", "schema": {}} plus
# registry.add(result=...) as its description when the module gives one.
SUMMARIES: dict[str, str] = {
    "agents.create": "Create an agent in a workspace.",
    "agents.get": "One agent by id.",
    "agents.list": "Agents, optionally of one workspace or status.",
    "agents.update": "Change an agent's fields. A new `cooldown_s` applies to a cooldown "
                     "in force too, counted from the agent's last run's end (0 ends it).",
    "office.budgets.create": "Create a budget.",
    "office.budgets.list": "Budgets of a workspace.",
    "office.projects.create": "Create a project in a workspace.",
    "office.projects.list": "Projects of a workspace.",
    "office.routines.create": "Create a routine (a cron-driven run of an agent).",
    "office.routines.list": "Routines of a workspace.",
    "office.routines.update": "Change a routine's fields.",
    "products.activity": "A user was active in a product (quiet_minutes schedules wait).",
    "runs.cancel": "Cancel a queued or running run.",
    "runs.enqueue": "Queue a run of an agent (idempotent by key, coalescing by default).",
    "runs.explain": "Why a run is where it is (its gates and history).",
    "runs.get": "One run by id.",
    "runs.list": "Runs, filtered and paged.",
    "runs.retry": "Queue a failed or cancelled run again.",
    "scheduler.config.get": "The scheduler's settings (the global pause).",
    "scheduler.config.put": "Set or clear the global pause.",
    "scheduler.jobs.backfill": "Run (or list) a job's fire times over a past range.",
    "scheduler.jobs.create": "Add a schedule to a workflow.",
    "scheduler.jobs.delete": "Remove a workflow schedule.",
    "scheduler.jobs.disable": "Disable a job.",
    "scheduler.jobs.enable": "Enable a job.",
    "scheduler.jobs.get": "One job by id.",
    "scheduler.jobs.list": "Workflow and product jobs.",
    "scheduler.jobs.next": "A job's (or an expression's) coming fire times.",
    "scheduler.jobs.runs": "A job's past runs.",
    "scheduler.jobs.stop": "Stop a job's running session.",
    "scheduler.jobs.trigger": "Fire a job now.",
    "scheduler.jobs.update": "Change a workflow schedule.",
    "scheduler.reload": "Rescan the workflow root, products and users (as SIGHUP does).",
    "tasks.create": "Create a task.",
    "tasks.get": "One task by id.",
    "tasks.launch": "Queue a run for a task.",
    "tasks.list": "Tasks, filtered and paged.",
    "tasks.move": "Move a task to a workflow step.",
    "tasks.update": "Change a task's fields.",
    "workflows.create": "Create a workflow.",
    "workflows.get": "One workflow by id.",
    "workflows.list": "Workflows, optionally of one workspace or style.",
    "workspaces.create": "Create a workspace.",
    "workspaces.get": "One workspace by id.",
    "workspaces.list": "Workspaces, paged.",
    "workspaces.update": "Change a workspace's fields.",
}


#: What each method returns (methods that give ``registry.add(result=...)`` win).
RESULTS: dict[str, str] = {
    'agents.create':
        ('AGENT {id, workspace_id, name, profile, cooldown_s, status, cooldown_until, '
         'last_finished_at, created_at, updated_at, runs_on}'),
    'agents.get':
        'AGENT; not_found for an unknown id',
    'agents.list':
        '{items: [AGENT], total, limit, offset}',
    'agents.update':
        'AGENT as updated',
    'office.budgets.create':
        ('BUDGET {id, workspace_id, scope_type, scope_id, limit_cents, period, '
         'alert_threshold_pct, action_on_exceed, created_at}'),
    'office.budgets.list':
        '{items: [BUDGET], total, limit, offset}',
    'office.projects.create':
        'PROJECT {id, workspace_id, name, created_at}',
    'office.projects.list':
        '{items: [PROJECT], total, limit, offset}',
    'office.routines.create':
        ('ROUTINE {id, workspace_id, agent_id, name, cron_expression, timezone, payload, '
         'status, concurrency_policy, catch_up_policy, catch_up_max, next_run_at, last_run_at,'
         ' ...}'),
    'office.routines.list':
        '{items: [ROUTINE], total, limit, offset}',
    'office.routines.update':
        'ROUTINE as updated (next_run_at recomputed when the schedule changed)',
    'products.activity':
        '{user_id, profile, at}: the activity recorded',
    'runs.cancel':
        'RUN, now cancelled; conflict when it is already finished, failed or cancelled',
    'runs.enqueue':
        '{run: RUN, deduplicated: bool, coalesced: bool}',
    'runs.explain':
        '{eligible: bool, blockers: [name], details: {blocker: detail}}',
    'runs.get':
        ('RUN {id, seq, workspace_id, agent_id, task_id, reason, payload, status, '
         'idempotency_key, coalesced_count, retry_count, scheduled_retry_at, requested_at, '
         'claimed_at, finished_at, error_message, cancel_reason, output_summary, cost_cents, '
         'log_path, attempt}'),
    'runs.list':
        '{items: [RUN], total, limit, offset}, in request order (order: desc = newest first)',
    'runs.retry':
        'RUN, queued again; conflict unless it was failed or cancelled',
    'scheduler.config.get':
        ('{globally_paused, paused_at, paused_by, updated_at, execution_enabled, '
         'disabled_via_env, disabled_reason, ...switches}'),
    'scheduler.config.put':
        'the scheduler config as stored (see scheduler.config.get)',
    'scheduler.jobs.create':
        'JOB of the new schedule',
    'scheduler.jobs.delete':
        '{id, deleted: true}',
    'scheduler.jobs.disable':
        'JOB, disabled',
    'scheduler.jobs.enable':
        'JOB, enabled',
    'scheduler.jobs.get':
        'JOB (see docs/scheduling.md, Jobs)',
    'scheduler.jobs.backfill':
        '{id, times: [{utc, local}], started}; conflict while a backfill of the job runs',
    'scheduler.jobs.list':
        '{items: [JOB], total, limit, offset}',
    'scheduler.jobs.next':
        '{times: [{utc, local}], timezone, cron_expression}',
    'scheduler.jobs.runs':
        '{items: [history entry], total, limit, offset}, newest first',
    'scheduler.jobs.stop':
        '{id, session_id, run_id, stopping, backfill}; not_running when nothing runs',
    'scheduler.jobs.trigger':
        '{id, session_id, run_id, ...}; already_running when a session is in flight',
    'scheduler.jobs.update':
        'JOB as updated',
    'scheduler.reload':
        ('what changed: the job ids added, changed, removed and invalid, the counts, and '
         'every problem found'),
    'tasks.create':
        ('TASK {id, workspace_id, workflow_id, step_id, title, project_id, state, '
         'runner_agent_id, runner, created_at, updated_at}'),
    'tasks.get':
        'TASK',
    'tasks.launch':
        '{session_id}: the launched execution (it bypasses the queue)',
    'tasks.list':
        '{items: [TASK], total, limit, offset}',
    'tasks.move':
        ('{task: TASK, actions: [{action, target, agent_id?, run_id?, deduplicated?, '
         'coalesced?, skipped?}]}'),
    'tasks.update':
        'TASK as updated',
    'workflows.create':
        ('WORKFLOW {id, workspace_id, name, style, steps: [{id, name, agent_id, on_enter}], '
         'created_at}'),
    'workflows.get':
        'WORKFLOW',
    'workflows.list':
        '{items: [WORKFLOW], total, limit, offset}',
    'workspaces.create':
        'WORKSPACE {id, name, office_workflow_id, created_at, updated_at}',
    'workspaces.get':
        'WORKSPACE',
    'workspaces.list':
        '{items: [WORKSPACE], total, limit, offset}',
    'workspaces.update':
        'WORKSPACE as updated',
}


def _summary(method: Method) -> str:
    return method.summary or SUMMARIES.get(method.name, "")


def method_entry(method: Method) -> dict[str, Any]:
    schema = method.schema
    required = set(schema.get("required", []))
    params = [{"name": name, "required": name in required, "schema": sub}
              for name, sub in schema.get("properties", {}).items()]
    entry: dict[str, Any] = {"name": method.name}
    if summary := _summary(method):
        entry["summary"] = summary
    entry["params"] = params
    entry["paramStructure"] = "by-name"
    result: dict[str, Any] = {"name": "result", "schema": {}}
    description = method.result or RESULTS.get(method.name)
    if description:
        result["description"] = description
    entry["result"] = result
    return entry


def discover(registry: Registry) -> dict[str, Any]:
    """The OpenRPC document of every method, sorted by name."""
    return {"openrpc": OPENRPC_VERSION, "info": {"title": "kandevd", "version": __version__},
            "methods": [method_entry(m) for m in registry.methods()]}
