"""Options every command shares: --home on every command, --user on every job command."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kandevd.cli.common import error_line
from kandevd.cli.jobs_change import timing
from kandevd.cli.main import cli


def leaves(group: click.Group, path: tuple[str, ...] = ()
           ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from leaves(command, (*path, name))
        else:
            yield (*path, name), command


def options(command: click.Command) -> set[str]:
    return {opt for param in command.params if isinstance(param, click.Option)
            for opt in param.opts}


def test_every_command_takes_home() -> None:
    commands = list(leaves(cli))
    assert len(commands) > 30
    missing = [" ".join(path) for path, command in commands if "--home" not in options(command)]
    assert missing == []


def test_every_jobs_command_that_names_a_job_takes_user() -> None:
    jobs = cli.commands["jobs"]
    assert isinstance(jobs, click.Group)
    named = [(path, command) for path, command in leaves(jobs)
             if any(p.name == "job_id" for p in command.params)]
    assert {path[0] for path, _ in named} >= {
        "get", "runs", "next", "logs", "trigger", "stop", "enable", "disable", "update",
        "delete"}
    assert [path for path, command in named if "--user" not in options(command)] == []
    assert "--user" in options(jobs.commands["list"])


def test_errors_name_the_options_the_user_typed() -> None:
    jobs = cli.commands["jobs"]
    assert isinstance(jobs, click.Group)
    backfill, get = jobs.commands["backfill"], jobs.commands["get"]
    invalid = {"kind": "invalid_params"}
    assert error_line({"message": "params.to: in the future", "data": invalid}, backfill) \
        == "--to: in the future"
    assert error_line({"message": "params.from: not a time", "data": invalid}, backfill) \
        == "--from: not a time"
    assert error_line({"message": "params.user_id: exists once per user: give user_id "
                       "(users: a, b)", "data": invalid}, get) == \
        "--user: exists once per user: give --user (users: a, b)"
    assert error_line({"message": "params.to: must not be earlier than params.from",
                       "data": invalid}, backfill) == "--to: must not be earlier than --from"
    create = jobs.commands["create"]
    assert error_line({"message": "workflow 'digest' already has a schedule 'hourly'",
                       "data": {"kind": "conflict"}}, create) \
        == "workflow 'digest' already has a schedule 'hourly' (conflict)"  # a word, not WORKFLOW


def test_a_job_is_shown_by_its_cron_or_its_cadence_never_as_none() -> None:
    assert timing({"cron_expression": "0 8 * * *", "cadence_hours": None}) == "0 8 * * *"
    assert timing({"cron_expression": None, "cadence_hours": 6}) == "every 6h"
    assert timing({"cron_expression": None}) == "-"


@pytest.mark.parametrize("args", [
    ["call", "daemon.status", '{"a": 1e999}'],
    ["jobs", "create", "w", "--id", "s", "--cron", "0 9 * * *", "--payload", '{"a": 1e999}'],
    ["runs", "enqueue", "--workspace", "w", "--agent", "a", "--reason", "r",
     "--payload", '{"a": NaN}'],
])
def test_json_the_daemon_would_refuse_is_a_usage_error_here(args: list[str],
                                                           tmp_path: Path) -> None:
    """1e999 and NaN are no JSON numbers: named at the option, before any daemon is asked."""
    result = CliRunner().invoke(cli, [*args, "--home", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "not valid JSON" in result.output


def test_a_malformed_after_is_a_usage_error_for_a_job_as_for_a_dry_run(tmp_path: Path) -> None:
    for args in (["jobs", "next", "workflow:w:s"], ["jobs", "next", "--cron", "0 9 * * *"]):
        result = CliRunner().invoke(cli, [*args, "--after", "2026-12-07", "--home",
                                          str(tmp_path)])
        assert result.exit_code == 2, result.output  # before any daemon is asked
        assert "is not an RFC 3339 timestamp" in result.output


@pytest.mark.parametrize("args", [
    ["office", "budgets", "create", "--workspace", "w", "--limit-cents", "nan"],
    ["agents", "update", "a1", "--cooldown", "inf"],
    ["wait", "--timeout", "nan"],
    ["wait", "--timeout", "-1"],
])
def test_a_number_option_refuses_nan_and_infinity_naming_itself(args: list[str]) -> None:
    """Sent on, NaN was the daemon's 'parse error', which named no option."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    option = args[-2]
    assert f"Invalid value for '{option}'" in result.output
    assert "finite number" in result.output or "less than 0" in result.output


def test_every_float_option_is_a_finite_number() -> None:
    from kandevd.cli.common import FiniteFloat

    loose = [(path, param.name) for path, command in leaves(cli) for param in command.params
             if isinstance(param.type, click.types.FloatParamType | click.FloatRange)
             and not isinstance(param.type, FiniteFloat)]
    assert loose == []
