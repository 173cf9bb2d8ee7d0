"""The command line: exit codes of CONTRACT.md section 1, status output, init, validate, help.

The commands run as real subprocesses (``python -m kandevd ...``) against a
real daemon; only the help walk uses click's in-process runner, since it
checks documentation, not behaviour.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kandevd import __version__, exits
from kandevd.cli import cli
from tests.support.daemon import DaemonProcess, run_cli

pytestmark = pytest.mark.integration



def walk(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                           click.Command]]:
    """Every command reachable from ``group``, with the words that invoke it."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from walk(command, (*path, name))


def test_every_command_is_documented_and_its_help_exits_0() -> None:
    runner = CliRunner()
    commands = list(walk(cli))
    assert {path[0] for path, _ in commands} >= {"serve", "init", "validate", "call", "status"}
    for path, command in [((), cli), *commands]:
        shown = " ".join(path) or "kandevd"
        assert command.help and command.help.strip(), f"{shown} has no help text"
        result = runner.invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (shown, result.output)
        assert command.help.strip().splitlines()[0] in result.output
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{shown} {param.opts[0]} has no help text"


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_status_prints_every_loop_with_its_state(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    expected = daemon.call("daemon.status")
    result = run_cli(daemon.home, "status")
    assert result.returncode == 0, result.stderr
    assert f"pid {expected['pid']}" in result.stdout and "state running" in result.stdout
    loops_line = next(line for line in result.stdout.splitlines() if line.startswith("loops"))
    for name, state in expected["loops"].items():
        assert f"{name}={state}" in loops_line
    raw = run_cli(daemon.home, "status", "--json")
    assert raw.returncode == 0 and json.loads(raw.stdout)["loops"] == expected["loops"]


def test_call_exit_codes_0_and_1(daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    ok = run_cli(daemon.home, "call", "daemon.status")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["pid"] == daemon.proc.pid

    unknown = run_cli(daemon.home, "call", "no.such.method")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert json.loads(unknown.stderr)["code"] == -32601

    bad_params = run_cli(daemon.home, "call", "runs.get", '{"id": 5}')
    assert bad_params.returncode == 1
    error = json.loads(bad_params.stderr)
    assert error["code"] == -32602 and error["data"]["kind"] == "invalid_params"

    missing = run_cli(daemon.home, "call", "runs.get", '{"id": "run-that-does-not-exist"}')
    assert missing.returncode == 1
    assert json.loads(missing.stderr)["data"]["kind"] == "not_found"

    via_socket = run_cli(daemon.home, "call", "daemon.status", "--socket", str(daemon.socket))
    assert via_socket.returncode == 0

    not_json = run_cli(daemon.home, "call", "daemon.status", "{oops")
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr  # a usage error

    from_stdin = subprocess.run([sys.executable, "-m", "kandevd", "call", "runs.list", "-",
                                 "--home", str(daemon.home)], input=b'{"limit": 1}',
                                capture_output=True, timeout=60)
    assert from_stdin.returncode == 0 and "items" in json.loads(from_stdin.stdout)
    not_utf8 = subprocess.run([sys.executable, "-m", "kandevd", "call", "runs.list", "-",
                               "--home", str(daemon.home)], input=b"\xff\xfe",
                              capture_output=True, timeout=60)
    said = not_utf8.stderr.decode()
    assert not_utf8.returncode == 2 and "Traceback" not in said, said
    assert "not UTF-8 text (byte 0xff at offset 0)" in said, said


def test_call_exits_69_when_no_daemon_listens(tmp_path: Path) -> None:
    home = tmp_path / "nobody-home"
    home.mkdir(mode=0o700)
    result = run_cli(home, "call", "daemon.status")
    assert result.returncode == exits.UNAVAILABLE
    assert "no kandevd is listening" in result.stderr
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(home / "kandevd.sock"))
    stale.close()  # a socket file nobody listens on, as a kill -9 leaves it
    for args in (("call", "daemon.status"), ("status",)):
        assert run_cli(home, *args).returncode == exits.UNAVAILABLE


def test_a_daemon_that_holds_the_home_but_no_socket_is_said_to_be_stopping(
        tmp_path: Path) -> None:
    """A stopping daemon removes its socket first and gives its lock up last: meanwhile
    the CLI says so instead of that no daemon runs (exit 69 either way)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    # A process that is a kandevd as far as the lock file and /proc tell.
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()",
                               "kandevd", "serve"], stdin=subprocess.PIPE)
    try:
        (home / "kandevd.lock").write_text(f"{holder.pid}\n")
        for args in (("status",), ("runs", "list")):
            result = run_cli(home, *args)
            assert result.returncode == exits.UNAVAILABLE
            assert f"kandevd (pid {holder.pid}) holds this home but takes no requests: " \
                "it is stopping" in result.stderr, result.stderr
    finally:
        holder.communicate(b"", timeout=30)
    gone = run_cli(home, "status")  # its pid left behind (a kill -9): no daemon
    assert gone.returncode == exits.UNAVAILABLE and "no kandevd is listening" in gone.stderr


def test_validate_exits_0_for_a_good_config_and_1_for_a_bad_one(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    defaults = run_cli(home, "validate")
    assert defaults.returncode == 0 and "built-in defaults" in defaults.stdout

    (home / "kandevd.yaml").write_text("queue:\n  safety_interval_s: 1\n")
    good = run_cli(home, "validate")
    assert good.returncode == 0 and str(home / "kandevd.yaml") in good.stdout

    (home / "kandevd.yaml").write_text("queue:\n  safety_interval_s: -1\n")
    bad = run_cli(home, "validate")
    assert bad.returncode == 1
    assert "queue.safety_interval_s: -1 is less than the minimum of 0.1" in bad.stderr

    other = tmp_path / "other.yaml"
    other.write_text("retry:\n  unknown_knob: true\n")
    explicit = run_cli(home, "validate", "--config", str(other))
    assert explicit.returncode == 1 and "retry.unknown_knob" in explicit.stderr


def test_serve_with_a_bad_config_exits_78(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "kandevd.yaml").write_text("office:\n  interval_s: -1\n")
    result = run_cli(home, "serve")
    assert result.returncode == 78
    assert "office.interval_s" in result.stderr


def test_init_lays_out_a_home_and_copies_an_example(tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    result = run_cli(home, "init")
    assert result.returncode == 0, result.stderr
    for folder in (home, home / "logs", home / "workspace"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder

    demo = tmp_path / "demo-home"
    result = run_cli(demo, "init", "--example", "demo")
    assert result.returncode == 0, result.stderr
    example = Path(__file__).resolve().parents[3] / "kandevd" / "examples" / "demo"
    copied = {p.relative_to(example) for p in example.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert copied and all((demo / rel).is_file() for rel in copied)
    assert run_cli(demo, "validate").returncode == 0  # the example's config is valid

    for name in ("no-such-example", "../etc"):
        refused = run_cli(tmp_path / "x", "init", "--example", name)
        assert refused.returncode == 1 and name in refused.stderr


def test_init_writes_a_systemd_unit_for_its_home_and_keeps_an_edited_one(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = run_cli(home, "init", "--systemd")
    assert result.returncode == 0, result.stderr
    unit = home / "kandevd.service"
    text = unit.read_text()
    [start] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert start.endswith(f"serve --home {home} --log-format json"), start
    assert "Type=notify" in text and stat.S_IMODE(unit.stat().st_mode) == 0o600
    assert "KillMode=process" in text  # agents outlive a crash, to be adopted
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                              text=True, timeout=60, check=False)
    assert verified.returncode == 0 and verified.stderr == "", verified.stderr
    unit.write_text("# edited by hand\n")
    again = run_cli(home, "init", "--systemd")
    assert again.returncode == 0 and "kept" in again.stdout
    assert unit.read_text() == "# edited by hand\n"


# -- the home is not changed behind the user's back -------------------------------------

ADVICE = "not the advised 0700"


def test_a_new_home_is_created_0700_and_an_existing_0700_home_gets_no_warning(
        tmp_path: Path) -> None:
    home = tmp_path / "a" / "b" / "home"
    daemon = DaemonProcess(home, None)
    shutil.rmtree(tmp_path / "a")  # the harness made it; serve must create it
    daemon.start()
    try:
        for folder in (tmp_path / "a", tmp_path / "a" / "b", home, home / "logs"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        assert ADVICE not in daemon.log_text
        assert daemon.stop() == 0
        daemon.start()  # now an existing 0700 home
        assert daemon.stop() == 0
        assert ADVICE not in daemon.log_text
    finally:
        daemon.cleanup()


@pytest.mark.parametrize(("mode", "reason"), [
    (0o755, "it is open to group and others"),
    (0o750, "it is open to group,"),
    (0o500, "its owner lacks write permission"),
])
def test_an_existing_home_keeps_its_mode_and_a_warning_names_it(
        tmp_path: Path, mode: int, reason: str) -> None:
    if mode == 0o500 and os.geteuid() != 0:
        pytest.skip("only root can run in a 0500 home (see the exit 73 test)")
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(mode)
    daemon = DaemonProcess(home, None)
    daemon.start()
    try:
        warning = daemon.wait_for_line(ADVICE)
        assert "WARNING" in warning and f"has mode {mode:04o}, {ADVICE}" in warning, warning
        assert reason in warning and "not changed" in warning, warning
        assert stat.S_IMODE(home.stat().st_mode) == mode  # while it runs
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert stat.S_IMODE(home.stat().st_mode) == mode  # and after it stopped
    assert "Traceback" not in daemon.log_text


def test_a_home_the_daemon_cannot_write_exits_73_and_is_left_as_it_is(tmp_path: Path) -> None:
    from tests.support.daemon import as_ordinary_user

    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    preexec = as_ordinary_user()
    result = subprocess.run([sys.executable, "-m", "kandevd", "serve", "--home", str(home)],
                            capture_output=True, text=True, timeout=60, preexec_fn=preexec)
    assert result.returncode == 73, result.stderr
    assert f"cannot use home {home}: cannot write it (mode 0500" in result.stderr
    assert "has mode 0500" in result.stderr and "Traceback" not in result.stderr
    assert stat.S_IMODE(home.stat().st_mode) == 0o500 and not list(home.iterdir())


def test_a_home_that_is_a_file_or_cannot_be_created_exits_73(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a home")
    for home, reason in ((a_file, "it exists and is not a directory"),
                         (a_file / "home", "cannot create it: Not a directory")):
        for command in ("serve", "init"):
            result = run_cli(home, command)
            assert result.returncode == 73, (command, result.stderr)
            assert f"cannot use home {home}: {reason}" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr
    assert a_file.read_text() == "not a home"


def test_init_keeps_an_existing_homes_mode_and_makes_only_what_it_copies_private(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o750)
    mine = home / "notes.txt"
    mine.write_text("mine")
    mine.chmod(0o644)
    result = run_cli(home, "init", "--example", "demo")
    assert result.returncode == 0, result.stderr
    assert f"home {home} has mode 0750, {ADVICE}" in result.stderr
    assert stat.S_IMODE(home.stat().st_mode) == 0o750
    assert stat.S_IMODE(mine.stat().st_mode) == 0o644  # not the example's: left alone
    assert stat.S_IMODE((home / "kandevd.yaml").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "workspace").stat().st_mode) == 0o700


def test_init_keeps_an_edited_file_and_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = run_cli(home, "init", "--example", "demo")
    assert first.returncode == 0, first.stderr
    config = home / "kandevd.yaml"
    config.write_text(config.read_text() + "# edited by hand\n")
    again = run_cli(home, "init", "--example", "demo")
    assert again.returncode == 0, again.stderr
    assert f"kept {config}" in again.stdout
    assert config.read_text().endswith("# edited by hand\n")
    assert f"next: kandevd serve --home {home}" in again.stdout
    forced = run_cli(home, "init", "--example", "demo", "--force")
    assert forced.returncode == 0 and "# edited by hand" not in config.read_text()


def test_init_with_a_bad_example_creates_nothing(tmp_path: Path) -> None:
    home = tmp_path / "never"
    refused = run_cli(home, "init", "--example", "no-such-example")
    assert refused.returncode != 0 and "no example named" in refused.stderr
    assert not home.exists()


def test_validate_flags_a_profile_whose_command_does_not_exist(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    config = tmp_path / "c.yaml"
    config.write_text("agents:\n  good: {command: [sh]}\n  typo: {command: [no-such-agent-x]}\n")
    result = run_cli(home, "validate", "--config", str(config))
    assert result.returncode == 1
    assert "profile good: sh ok" in result.stdout
    assert "profile typo: cannot start agent: executable not found: no-such-agent-x" \
        in result.stderr
    assert "profile default: the built-in echo agent" in result.stdout


def test_validate_flags_a_schedule_whose_agent_profile_is_not_configured(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_cli(home, "init", "--example", "demo").returncode == 0
    manifest = home / "workspace" / "Workflow" / "daily-digest" / "workflow.json"
    document = json.loads(manifest.read_text())
    document["agent_profile"] = "gpu"
    document["schedules"][0]["runs_on"] = ["gpu"]  # (a runner's config names its profiles)
    manifest.write_text(json.dumps(document))
    product = home / "workspace" / "products" / "assistant" / "product.yaml"
    product.write_text(product.read_text().replace("agent_profile: default",
                                                   "agent_profile: claude"))
    result = run_cli(home, "validate")
    assert result.returncode == 1
    assert (f"{manifest}: agent_profile 'gpu' is not configured (configured: default); "
            "every turn of weekday-morning would end in an error") in result.stderr
    assert f"{product}: agent_profile 'claude' is not configured" in result.stderr
    assert "2 file(s) name an agent profile the config lacks" in result.stdout

    document["schedules"][1]["runs_on"] = ["gpu"]  # every schedule runs on a runner: fine
    manifest.write_text(json.dumps(document))
    product.write_text(product.read_text().replace("claude", "default"))
    assert run_cli(home, "validate").returncode == 0


def test_validate_notes_a_home_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-home"
    result = run_cli(missing, "validate")
    assert result.returncode == 0  # (serve starts on it, creating it)
    assert f"note: the home {missing} does not exist (serve creates it" in result.stderr
    assert not missing.exists()  # validate writes nothing


def test_validate_lists_every_problem_of_the_config_and_serve_names_the_first(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "kandevd.yaml").write_text("queue:\n  safety_interval_s: -1\n"
                                       "runtime:\n  max_concurrent: many\nretri: {}\n")
    checked = run_cli(home, "validate")
    assert checked.returncode == 1
    where = home / "kandevd.yaml"
    assert checked.stderr.splitlines()[:3] == [
        f"invalid: {where}: retri: unknown key; did you mean retry?",
        f"invalid: {where}: queue.safety_interval_s: -1 is less than the minimum of 0.1",
        f"invalid: {where}: runtime.max_concurrent: 'many' is not of type 'integer'"]
    served = run_cli(home, "serve")
    assert served.returncode == 78
    assert served.stderr.strip() == f"kandevd: bad config: {where}: retri: unknown key; " \
        "did you mean retry?"
