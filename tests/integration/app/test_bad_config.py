"""A config that cannot break the daemon: `validate` and `serve` refuse every bad file alike.

Each bad config is fed to both real commands (subprocesses). Both refuse it
with one line that names the file and the key path (or the reason), never a
traceback: `serve` exits 78 (EX_CONFIG, CONTRACT.md section 1), `validate`
exits 1 (its "exit 0/1" in the same section). `serve` refuses before it
touches the home.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kandevd import exits
from kandevd.config import ConfigError, load_config
from tests.support.daemon import as_ordinary_user

pytestmark = pytest.mark.integration

# "Billion laughs": 9 strings, each level 9 aliases of the one before; 9**7 values expanded.
ALIAS_BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
    for prev, name in zip("abcdef", "bcdefg", strict=True))

# (id, file content, what the one-line message must say after "<file>: ")
BAD_CONFIGS: list[tuple[str, bytes, str]] = [
    ("nan", b"queue:\n  safety_interval_s: .nan\n", "queue.safety_interval_s: NaN is not allowed"),
    ("NaN-spelling", b"office:\n  interval_s: .NaN\n", "office.interval_s: NaN is not allowed"),
    ("inf", b"retry:\n  max_age_s: .inf\n", "retry.max_age_s: infinity is not allowed"),
    ("minus-inf-nested", b"agents:\n  default:\n    timeout_s: -.inf\n",
     "agents.default.timeout_s: -infinity is not allowed"),
    ("inf-in-other-profile", b"agents:\n  fast:\n    timeout_s: .Inf\n",
     "agents.fast.timeout_s: infinity is not allowed"),
    ("nan-in-list", b"retry:\n  delays_s: [1, .nan]\n", "retry.delays_s.1: NaN is not allowed"),
    ("overflow-to-inf", b"retry:\n  jitter: 1.0e+400\n", "retry.jitter: infinity is not allowed"),
    ("minus-inf-control", b"control:\n  idle_timeout_s: -.inf\n",
     "control.idle_timeout_s: -infinity is not allowed"),
    ("inf-where-int", b"runtime:\n  max_concurrent: .inf\n",
     "runtime.max_concurrent: infinity is not allowed"),
    ("non-utf8", b"queue:\n  safety_interval_s: 1  # caf\xe9\n",
     "not UTF-8 text: invalid continuation byte (byte 0xe9 at offset"),
    ("latin1-key", b"\xff\xfeq\x00", "not UTF-8 text"),
    ("alias-bomb", ALIAS_BOMB.encode(), "expands to more than 100000 values"),
    ("unknown-key", b"queue:\n  bogus: 1\n", "queue.bogus: unknown key"),
    ("unknown-section", b"nope: {}\n", "nope: unknown key"),
    ("wrong-type", b"runtime:\n  max_concurrent: four\n",
     "runtime.max_concurrent: 'four' is not of type 'integer'"),
    ("wrong-type-nested", b"agents:\n  default:\n    command: echo hi\n",
     "agents.default.command: 'echo hi' is not of type 'array', 'null'"),
    ("not-yaml", b"queue: [unclosed\n", "not valid YAML: line 2, column 1: "),
    ("not-a-mapping", b"- 1\n- 2\n", "<root>: [1, 2] is not of type 'object'"),
    # (a runner must be able to stop its agents in half of it, and heartbeat a quarter)
    ("gateway-dead-after-tiny", b"gateway:\n  dead_after_s: 0.001\n",
     "gateway.dead_after_s: 0.001 is less than the minimum of 2"),
]


def run(*args: str, preexec_fn: Callable[[], None] | None = None,
        timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kandevd", *args], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def assert_both_refuse(home: Path, config: Path | None, fragment: str,
                       preexec_fn: Callable[[], None] | None = None) -> None:
    """validate and serve on the same file: the same one-line reason, no traceback."""
    named = str(config if config is not None else home / "kandevd.yaml")
    extra = ["--config", str(config)] if config is not None else []
    home_existed = home.exists()
    validate = run("validate", "--home", str(home), *extra, preexec_fn=preexec_fn)
    serve = run("serve", "--home", str(home), *extra, preexec_fn=preexec_fn)
    for result, code, prefix in ((validate, exits.ERROR, "invalid: "),
                                 (serve, exits.CONFIG, "kandevd: bad config: ")):
        shown = f"{result.args[3]} exit {result.returncode}\n{result.stdout}{result.stderr}"
        assert result.returncode == code, shown
        assert "Traceback" not in result.stdout + result.stderr, shown
        assert result.stdout == "", shown
        lines = result.stderr.splitlines()
        assert lines and lines[0].startswith(f"{prefix}{named}: "), shown
        assert fragment in lines[0], shown
    assert serve.stderr.splitlines() == [serve.stderr.splitlines()[0]]  # that one line only
    assert validate.stderr.splitlines()[1:] == ["workflows not checked: the config is invalid"]
    assert validate.stderr.splitlines()[0].removeprefix("invalid: ") == \
        serve.stderr.splitlines()[0].removeprefix("kandevd: bad config: ")  # they agree
    assert home.exists() == home_existed  # refused before the home is touched


@pytest.mark.parametrize(("content", "fragment"), [(c, f) for _, c, f in BAD_CONFIGS],
                         ids=[name for name, _, _ in BAD_CONFIGS])
def test_validate_and_serve_refuse_a_bad_config_file_alike(
        tmp_path: Path, content: bytes, fragment: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    assert_both_refuse(tmp_path / "home", config, fragment)


def test_a_bad_kandevd_yaml_in_the_home_is_refused_alike(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "kandevd.yaml").write_bytes(b"agents:\n  default:\n    timeout_s: .nan\n")
    assert_both_refuse(home, None, "agents.default.timeout_s: NaN is not allowed")


def test_a_directory_or_a_missing_file_as_config_is_refused_alike(tmp_path: Path) -> None:
    folder = tmp_path / "conf.d"
    folder.mkdir()
    assert_both_refuse(tmp_path / "home", folder, "cannot read config: is a directory")
    assert_both_refuse(tmp_path / "home", tmp_path / "missing.yaml",
                       "cannot read config: No such file or directory")


def test_an_unreadable_config_file_is_refused_alike(tmp_path: Path) -> None:
    config = tmp_path / "secret.yaml"
    config.write_text("queue:\n  safety_interval_s: 1\n")
    config.chmod(0o000)
    preexec = as_ordinary_user()
    try:
        assert_both_refuse(tmp_path / "home", config, "cannot read config: Permission denied",
                           preexec_fn=preexec)
    finally:
        config.chmod(0o600)


def test_an_alias_bomb_is_refused_in_milliseconds(tmp_path: Path) -> None:
    config = tmp_path / "bomb.yaml"
    config.write_text(ALIAS_BOMB)  # 9**7 = 4.8 million "lol"s once expanded
    started = time.monotonic()
    with pytest.raises(ConfigError, match="expands to more than 100000 values"):
        load_config(config, environ={})
    assert time.monotonic() - started < 0.5
    # a few aliases (one shared env for two profiles) are fine
    shared = tmp_path / "shared.yaml"
    shared.write_text("agents:\n  a: {timeout_s: 5, env: &env {TOKEN: x}}\n"
                      "  b: {timeout_s: 6, env: *env}\n")
    assert dict(load_config(shared, environ={}).agents["b"].env) == {"TOKEN": "x"}


def test_a_good_config_still_validates_with_exit_0(tmp_path: Path) -> None:
    config = tmp_path / "good.yaml"
    config.write_text("queue:\n  safety_interval_s: 0.5\nagents:\n  default:\n"
                      "    timeout_s: '1e3'\n")  # quoted: text, the wrong type
    bad = run("validate", "--home", str(tmp_path / "home"), "--config", str(config))
    assert bad.returncode == exits.ERROR
    assert "agents.default.timeout_s: '1e3' is not of type 'number'" in bad.stderr
    for number in ("1e3", "1.0e+3", "1.5e3"):  # (YAML 1.1 reads the first and last as text)
        config.write_text("queue:\n  safety_interval_s: 0.5\nagents:\n  default:\n"
                          f"    timeout_s: {number}\n")
        good = run("validate", "--home", str(tmp_path / "home"), "--config", str(config))
        assert good.returncode == 0, (number, good.stderr)
        assert f"config ok: {config}" in good.stdout


def test_a_postgresql_store_that_cannot_be_reached_exits_74_without_its_password(
        tmp_path: Path) -> None:
    """The config is valid (validate says so); serve cannot open the database: one line,
    exit 74 (EX_IOERR, as for a SQLite file that cannot be opened), no password shown."""
    config = tmp_path / "pg.yaml"
    config.write_text("store:\n  url: postgresql://kan:s3cret@127.0.0.1:1/kandevd\n"
                      "cluster:\n  heartbeat_s: 1\n  dead_after_s: 5\n")
    validate = run("validate", "--home", str(tmp_path / "home"), "--config", str(config))
    assert validate.returncode == 0, validate.stderr
    serve = run("serve", "--home", str(tmp_path / "home"), "--config", str(config))
    assert serve.returncode == 74, serve.stderr
    assert "store.url postgresql://kan:***@127.0.0.1:1/kandevd: the database cannot be used" \
        in serve.stderr
    assert "s3cret" not in validate.stdout + validate.stderr + serve.stdout + serve.stderr
    assert "Traceback" not in serve.stderr


def test_a_postgresql_store_without_its_driver_is_refused_naming_the_extra(
        tmp_path: Path) -> None:
    """Without psycopg, validate and serve refuse (78) naming `pip install 'kandevd[postgres]'`."""
    config = tmp_path / "pg.yaml"
    config.write_text("store:\n  url: postgresql://kan:s3cret@db.example:5432/kandevd\n")
    script = ("import sys; sys.modules['psycopg'] = None; from kandevd.cli import main; "
              "sys.argv = ['kandevd', *sys.argv[1:]]; main()")
    for command, code in (("validate", exits.ERROR), ("serve", exits.CONFIG)):
        result = subprocess.run(
            [sys.executable, "-c", script, command, "--home", str(tmp_path / "home"),
             "--config", str(config)], capture_output=True, text=True, timeout=60)
        assert result.returncode == code, result.stderr
        assert "store.url: postgresql://kan:***@db.example:5432/kandevd needs the PostgreSQL " \
            "driver" in result.stderr
        assert "pip install 'kandevd[postgres]'" in result.stderr
        assert "s3cret" not in result.stdout + result.stderr


def test_the_contracts_store_and_cluster_defaults_are_accepted(tmp_path: Path) -> None:
    config = tmp_path / "defaults.yaml"
    config.write_text("store:\n  url: null\ncluster:\n  heartbeat_s: 2\n  dead_after_s: 10\n")
    result = run("validate", "--home", str(tmp_path / "home"), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"config ok: {config}")


def test_a_directory_where_the_homes_config_belongs_is_refused_not_ignored(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "kandevd.yaml").mkdir(parents=True)
    assert_both_refuse(home, None, "cannot read config: is a directory, not a file")


@pytest.mark.parametrize("section", ["web", "gateway"])
def test_a_certificate_that_cannot_be_used_is_refused_alike_before_the_home(
        tmp_path: Path, section: str) -> None:
    """The console's and the gateway's TLS files are read before the home is made: one
    line from both commands, naming the section's keys."""
    config = tmp_path / "tls.yaml"
    config.write_text(f"{section}:\n  listen: 127.0.0.1:0\n"
                      f"  tls_cert: {tmp_path / 'missing.crt'}\n"
                      f"  tls_key: {tmp_path / 'missing.key'}\n")
    assert_both_refuse(tmp_path / "home", config,
                       f"{section}.tls_cert {str(tmp_path / 'missing.crt')!r}")
