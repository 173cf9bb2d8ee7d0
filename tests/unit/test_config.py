"""Config: the contract's defaults, key-path error messages, env overrides, immutability."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kandevd.config import (
    DEFAULTS,
    Config,
    ConfigError,
    UnknownProfile,
    build_config,
    load_config,
)
from kandevd.formats import yamlsafe
from kandevd.schedules.settings import Switches

REPO = Path(__file__).resolve().parents[2]

# CONTRACT.md section 2, verbatim: "Every key is optional; these are the defaults."
CONTRACT_DEFAULTS: dict[str, Any] = {
    "store": {"url": None},
    "cluster": {"heartbeat_s": 2, "dead_after_s": 10, "fence_after_s": None,
                "on_partition": "fence"},
    "queue": {"safety_interval_s": 5, "max_claims_per_tick": 10, "stale_claim_s": 1800,
              "max_attempts": 6, "retention_days": 30},
    "retry": {"max_retries": 4, "delays_s": [120, 600, 1800, 7200], "jitter": 0.25,
              "max_age_s": 86400},
    "runtime": {"max_concurrent": 4, "stop_grace_s": 20, "adopt_on_restart": True,
                "keep_agents_on_stop": False},
    "control": {"idle_timeout_s": 60},
    "metrics": {"listen": None},
    "web": {"listen": None},
    # section 10: `gateway: {listen, tls_cert?, tls_key?, dead_after_s: 30}`, off by default
    "gateway": {"listen": None, "tls_cert": None, "tls_key": None, "dead_after_s": 30},
    "office": {"enabled": True, "interval_s": 30, "recovery_lookback_hours": 24},
    "scheduler": {"enabled": True, "root": None, "history_retention_days": 90,
                  "notify": {"command": None, "webhook": None, "on": ["failure", "recovery"]}},
    "agents": {"default": {"command": None, "timeout_s": 3600, "env": {}}},
}
#: Keys the daemon offers beyond the contract's list (every one optional).
EXTENSIONS: dict[str, Any] = {"log": {"level": None},
                              "web": {**CONTRACT_DEFAULTS["web"], "allowed_hosts": [],
                                      "tls_cert": None, "tls_key": None,
                                      "insecure_remote": False},
                              "gateway": {**CONTRACT_DEFAULTS["gateway"],
                                          "insecure_remote": False},
                              "control": {**CONTRACT_DEFAULTS["control"],
                                          "event_buffer": 10000}}
ALL_DEFAULTS: dict[str, Any] = {**CONTRACT_DEFAULTS, **EXTENSIONS}


def as_document(config: Config) -> dict[str, Any]:
    """The Config back in the shape of kandevd.yaml, to compare with a document."""
    def section(obj: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                  if f.name not in drop}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    return {
        "queue": section(config.queue), "retry": section(config.retry),
        "runtime": section(config.runtime), "control": section(config.control),
        "metrics": section(config.metrics), "log": {"level": config.log_level},
        "web": section(config.web), "gateway": section(config.gateway),
        "store": section(config.store), "cluster": section(config.cluster),
        "office": section(config.office),
        "scheduler": section(config.scheduler, drop=("disabled_via_env", "unknown_env_switch",
                                                       "configured_enabled")),
        "agents": {name: {"command": None if p.command is None else list(p.command),
                          "timeout_s": p.timeout_s, "env": dict(p.env)}
                   for name, p in config.agents.items()},
    }


def error_for(document: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(document, environ={})
    return str(info.value)


# -- defaults ----------------------------------------------------------------------------


def test_defaults_are_the_contracts() -> None:
    assert DEFAULTS == ALL_DEFAULTS
    config = build_config(None, environ={})
    assert as_document(config) == ALL_DEFAULTS
    assert config.source is None
    assert config.scheduler.disabled_via_env is False


def test_the_shipped_annotated_config_matches_the_defaults() -> None:
    document = yamlsafe.loads((REPO / "kandevd" / "conf" / "kandevd.yaml").read_text())
    assert document == ALL_DEFAULTS
    assert build_config(document, environ={}).queue == build_config(None, environ={}).queue


def test_every_key_is_optional_and_a_partial_file_keeps_the_other_defaults() -> None:
    config = build_config({"queue": {"safety_interval_s": 0.5},
                           "agents": {"fast": {"timeout_s": 10}}}, environ={})
    assert config.queue.safety_interval_s == 0.5
    assert config.queue.max_claims_per_tick == CONTRACT_DEFAULTS["queue"]["max_claims_per_tick"]
    assert config.retry.delays_s == tuple(CONTRACT_DEFAULTS["retry"]["delays_s"])
    assert set(config.agents) == {"default", "fast"}  # `default` always exists
    assert config.agents["fast"].command is None and config.agents["fast"].timeout_s == 10
    assert config.profile("fast").name == "fast"
    with pytest.raises(UnknownProfile, match="'unknown-profile' is not configured"):
        config.profile("unknown-profile")  # never silently another agent
    # 0 days: keep everything, for the schedules' history as for the runs
    kept = build_config({"scheduler": {"history_retention_days": 0},
                         "queue": {"retention_days": 0}}, environ={})
    assert (kept.scheduler.history_retention_days, kept.queue.retention_days) == (0, 0)


def test_yaml_numbers_with_an_exponent_are_numbers_as_in_json(tmp_path: Path) -> None:
    """YAML 1.1 reads 1e3 and 1.5e3 as strings (it wants 1.5e+3): a config's 1e3 is a
    number, as the user wrote it; quoted, or not a number at all, it stays text."""
    loaded = yamlsafe.loads("a: 1e3\nb: -2E-2\nc: 1.5e3\nd: .5e1\ne: '1e3'\nf: 1e\n"
                            "g: e3\nh: 12\ni: 1.5e+3\n")
    assert loaded == {"a": 1000.0, "b": -0.02, "c": 1500.0, "d": 5.0, "e": "1e3",
                      "f": "1e", "g": "e3", "h": 12, "i": 1500.0}
    path = tmp_path / "kandevd.yaml"
    path.write_text("runtime:\n  stop_grace_s: 1e3\n")
    assert load_config(path, environ={}).runtime.stop_grace_s == 1000.0


def test_yaml_keys_that_are_not_strings_are_rejected_with_their_path() -> None:
    with pytest.raises(ConfigError, match=r"agents: key True must be a string"):
        build_config({"agents": {True: {"timeout_s": 1}}}, environ={})


def test_config_is_immutable_and_building_never_touches_the_defaults() -> None:
    config = build_config({"agents": {"default": {"env": {"A": "1"}}}}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.queue.safety_interval_s = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.agents["x"] = config.agents["default"]  # type: ignore[index]
    with pytest.raises(TypeError):
        config.agents["default"].env["B"] = "2"  # type: ignore[index]
    assert DEFAULTS == ALL_DEFAULTS


# -- errors name the key path -------------------------------------------------------------


def test_a_value_below_the_minimum_names_its_key_path() -> None:
    assert error_for({"queue": {"safety_interval_s": -1}}) == \
        "queue.safety_interval_s: -1 is less than the minimum of 0.1"


@pytest.mark.parametrize(("document", "path"), [
    ({"bogus": 1}, "bogus"),
    ({"queue": {"safety_interval": 5}}, "queue.safety_interval"),
    ({"agents": {"default": {"cmd": ["x"]}}}, "agents.default.cmd"),
])
def test_an_unknown_key_is_named_at_its_own_path(document: dict[str, Any], path: str) -> None:
    message = error_for(document)
    assert message.startswith(f"{path}: unknown key"), message


@pytest.mark.parametrize(("document", "path"), [
    ({"runtime": {"max_concurrent": "four"}}, "runtime.max_concurrent"),
    ({"runtime": {"max_concurrent": 0}}, "runtime.max_concurrent"),
    ({"retry": {"delays_s": [120, -5]}}, "retry.delays_s.1"),
    ({"retry": {"max_retries": 1.5}}, "retry.max_retries"),
    ({"office": {"enabled": "yes"}}, "office.enabled"),
    ({"scheduler": {"root": 7}}, "scheduler.root"),
    ({"agents": {"default": {"command": "echo hi"}}}, "agents.default.command"),
    ({"agents": {"default": {"env": {"N": 1}}}}, "agents.default.env.N"),
    ({"queue": None}, "queue"),
])
def test_a_wrong_type_or_range_names_its_key_path(document: dict[str, Any], path: str) -> None:
    message = error_for(document)
    assert message.startswith(f"{path}: "), message


@pytest.mark.parametrize("key", ["queue.safety_interval_s", "queue.stale_claim_s",
                                 "retry.max_age_s", "runtime.stop_grace_s", "office.interval_s",
                                 "agents.default.timeout_s"])
def test_every_duration_rejects_a_negative_value_by_path(key: str) -> None:
    document: dict[str, Any] = {}
    cursor = document
    *parents, leaf = key.split(".")
    for part in parents:
        cursor = cursor.setdefault(part, {})
    cursor[leaf] = -1
    assert error_for(document).startswith(f"{key}: -1 is less than ")


def test_a_document_that_is_not_a_mapping_is_rejected() -> None:
    assert error_for([1, 2]).startswith("<root>: ")


def test_load_config_prefixes_the_file_and_reports_bad_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("queue:\n  safety_interval_s: -1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: queue\.safety_interval_s: -1 is less"):
        load_config(bad, environ={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("queue: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken, environ={})
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_a_key_given_twice_is_refused_not_half_dropped(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text("queue: {safety_interval_s: 5}\nruntime: {max_concurrent: 2}\n"
                     "queue: {max_attempts: 3}\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml: not valid YAML: line 3: key 'queue' "
                                          r"given twice \(first on line 1\)"):
        load_config(twice, environ={})
    # Nested too; a merge key (<<) is not a repeated key.
    with pytest.raises(yamlsafe.YamlError, match="line 3: key 'x' given twice"):
        yamlsafe.loads("a:\n  x: 1\n  x: 2\n")
    assert yamlsafe.loads("b: &b {x: 1}\nc: {<<: *b, y: 2}\n") == {"b": {"x": 1},
                                                                   "c": {"x": 1, "y": 2}}


def test_load_config_finds_the_home_file_and_an_explicit_file_wins(tmp_path: Path) -> None:
    assert load_config(None, home=tmp_path, environ={}).source is None  # no file: defaults
    (tmp_path / "kandevd.yaml").write_text("runtime:\n  max_concurrent: 2\n")
    from_home = load_config(None, home=tmp_path, environ={})
    assert from_home.runtime.max_concurrent == 2
    assert from_home.source == str(tmp_path / "kandevd.yaml")
    explicit = tmp_path / "other.yaml"
    explicit.write_text("runtime:\n  max_concurrent: 3\n")
    assert load_config(explicit, home=tmp_path, environ={}).runtime.max_concurrent == 3
    empty = tmp_path / "empty.yaml"
    empty.write_text("")  # an empty file is "every key left at its default"
    assert load_config(empty, environ={}).runtime.max_concurrent == 4


# -- environment -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "FALSE", "0", "no", "off", " False "])
def test_scheduler_enabled_false_turns_automatic_execution_off(value: str) -> None:
    config = build_config(None, environ={"SCHEDULER_ENABLED": value})
    assert config.scheduler.enabled is False
    assert config.scheduler.disabled_via_env is True


@pytest.mark.parametrize("environ", [{}, {"SCHEDULER_ENABLED": "true"},
                                     {"SCHEDULER_ENABLED": "1"}, {"SCHEDULER_ENABLED": " Yes"},
                                     {"SCHEDULER_ENABLED": "on"}, {"SCHEDULER_ENABLED": ""}])
def test_scheduler_stays_on_unless_the_env_says_false(environ: dict[str, str]) -> None:
    config = build_config(None, environ=environ)
    assert config.scheduler.enabled is True and config.scheduler.disabled_via_env is False
    assert config.scheduler.unknown_env_switch is None


@pytest.mark.parametrize("value", ["flase", "disabled", "2", "enable"])
def test_a_scheduler_switch_that_is_neither_on_nor_off_turns_cron_off(value: str) -> None:
    """A typo in the kill switch: it was set to say something, and a fire made by mistake
    cannot be taken back, so cron is off, and the reason names the value."""
    config = build_config(None, environ={"SCHEDULER_ENABLED": value})
    assert config.scheduler.enabled is False and config.scheduler.disabled_via_env is True
    assert config.scheduler.unknown_env_switch == value
    switches = Switches.from_config(config.scheduler)
    assert not switches.execution_enabled
    assert switches.disabled_reason == (
        f"SCHEDULER_ENABLED={value!r} in the environment, neither on (1, true, yes, on) "
        "nor off (0, false, no, off)")


def test_the_env_wins_over_the_file_but_never_turns_a_disabled_scheduler_on() -> None:
    on_in_file = build_config({"scheduler": {"enabled": True}},
                              environ={"SCHEDULER_ENABLED": "false"})
    assert on_in_file.scheduler.enabled is False
    off_in_file = build_config({"scheduler": {"enabled": False}},
                               environ={"SCHEDULER_ENABLED": "true"})
    assert off_in_file.scheduler.enabled is False
    assert off_in_file.scheduler.disabled_via_env is False


# -- NaN, infinity, unreadable files, alias bombs ---------------------------------------


@pytest.mark.parametrize(("document", "message"), [
    ({"queue": {"safety_interval_s": float("nan")}}, "queue.safety_interval_s: NaN is not allowed"),
    ({"retry": {"delays_s": [1, float("inf")]}}, "retry.delays_s.1: infinity is not allowed"),
    ({"agents": {"default": {"timeout_s": float("-inf")}}},
     "agents.default.timeout_s: -infinity is not allowed"),
    ({"agents": {"x": {"env": {"A": float("nan")}}}}, "agents.x.env.A: NaN is not allowed"),
    ({"runtime": {"max_concurrent": float("inf")}},
     "runtime.max_concurrent: infinity is not allowed"),
])
def test_nan_and_infinity_are_refused_with_the_key_path(document: Any, message: str) -> None:
    assert error_for(document) == message


def test_the_schema_itself_refuses_nan_and_infinity() -> None:
    """minimum/maximum let NaN through (every comparison with it is false): the validator's
    "number" type excludes it, so the schema alone refuses too."""
    from kandevd.config import FiniteValidator, _schema

    validator = FiniteValidator(_schema())
    for value in (float("nan"), float("inf"), float("-inf")):
        for document in ({"queue": {"safety_interval_s": value}},
                         {"agents": {"default": {"timeout_s": value}}},
                         {"retry": {"jitter": value}}):
            assert list(validator.iter_errors(document)), document
    assert not list(validator.iter_errors({"queue": {"safety_interval_s": 0.5}}))


def test_the_check_after_loading_refuses_a_non_finite_built_value() -> None:
    from kandevd.config import check_config_finite

    config = build_config(None, environ={})
    check_config_finite(config)  # the defaults are fine
    broken = dataclasses.replace(config, queue=dataclasses.replace(
        config.queue, safety_interval_s=float("nan")))
    with pytest.raises(ConfigError, match=r"^queue\.safety_interval_s: NaN is not allowed$"):
        check_config_finite(broken)
    broken = dataclasses.replace(config, retry=dataclasses.replace(
        config.retry, delays_s=(1.0, float("-inf"))))
    with pytest.raises(ConfigError, match=r"^retry\.delays_s\.1: -infinity is not allowed$"):
        check_config_finite(broken)
    profile = dataclasses.replace(config.agents["default"], timeout_s=float("inf"))
    with pytest.raises(ConfigError, match=r"^agents\.default\.timeout_s: infinity"):
        check_config_finite(dataclasses.replace(config, agents={"default": profile}))


@pytest.mark.parametrize(("content", "message"), [
    (b"queue:\n  safety_interval_s: .nan\n", "queue.safety_interval_s: NaN is not allowed"),
    (b"retry:\n  max_age_s: -.inf\n", "retry.max_age_s: -infinity is not allowed"),
    (b"a: \xff\n", "not UTF-8 text: invalid start byte (byte 0xff at offset 3, line 1)"),
    (b"queue: {\n", "not valid YAML: line 2, column 1: "),
    (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c,"
     b" *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n",
     "expands to more than 100000 values (through YAML aliases): refused"),
])
def test_load_config_reports_a_bad_file_in_one_line(tmp_path: Path, content: bytes,
                                                    message: str) -> None:
    path = tmp_path / "kandevd.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    text = str(info.value)
    assert text.startswith(f"{path}: {message}") and "\n" not in text


def test_load_config_refuses_a_directory_and_a_huge_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config: is a directory, not a file"):
        load_config(tmp_path, environ={})
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1024 * 1024) + "\n")
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config(big, environ={})


def test_a_utf8_bom_and_a_few_aliases_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "kandevd.yaml"
    path.write_bytes(b"\xef\xbb\xbfagents:\n  a: {env: &e {K: v}}\n  b: {env: *e}\n")
    config = load_config(path, environ={})
    assert dict(config.agents["b"].env) == {"K": "v"}


def test_log_level_is_read_upper_cased_and_unknown_levels_are_refused() -> None:
    assert build_config({"log": {"level": "debug"}}, environ={}).log_level == "DEBUG"
    assert build_config(None, environ={}).log_level is None
    with pytest.raises(ConfigError, match=r"log\.level"):
        build_config({"log": {"level": "LOUD"}}, environ={})


def test_config_changes_names_sections_and_profiles_but_not_the_log_level() -> None:
    from kandevd.app.reload import config_changes

    running = build_config({"log": {"level": "INFO"}}, environ={})
    fresh = build_config({"log": {"level": "DEBUG"}, "queue": {"max_attempts": 2},
                          "agents": {"coder": {"command": ["/bin/true"]}}}, environ={})
    assert config_changes(running, fresh) == ["queue", "agents.coder"]
    assert config_changes(running, build_config({"log": {"level": "ERROR"}}, environ={})) == []


def test_the_store_url_takes_postgresql_urls_and_never_shows_a_password() -> None:
    from kandevd.net.urls import redact_url

    secret = "postgresql://kan:s3cret@db.example:5432/kandevd"
    assert build_config({"store": {"url": secret}}, environ={}).store.url == secret
    assert "s3cret" not in repr(build_config({"store": {"url": secret}}, environ={}))
    assert redact_url(secret) == "postgresql://kan:***@db.example:5432/kandevd"
    assert redact_url("postgres://db/k") == "postgres://db/k"
    message = error_for({"store": {"url": "mysql://kan:s3cret@db/k"}})
    assert message.startswith("store.url: mysql://kan:***@db/k is not a postgresql:// URL")
    assert "s3cret" not in message
    assert redact_url("postgresql://u:pw@h/db?sslmode=require&password=q1&x=1") == \
        "postgresql://u:***@h/db?sslmode=require&password=***&x=1"
    assert redact_url("postgresql:///db?PASSWORD=q2") == "postgresql:///db?PASSWORD=***"
    for leaky in ("host=h user=u password=kv1", ["postgresql://u:s3cret@h/db"],
                  {"dsn": "postgresql://u:s3cret@h/db"}):
        text = error_for({"store": {"url": leaky}})
        assert text.startswith("store.url: ") and "s3cret" not in text and "kv1" not in text
    assert "s3cret" not in error_for({"store": "postgresql://u:s3cret@h/db"})
    assert "must be more than cluster.heartbeat_s" in error_for(
        {"cluster": {"heartbeat_s": 5, "dead_after_s": 5}})
