"""Configuration: ``kandevd.yaml`` + JSON Schema + environment -> a frozen Config.

The file is optional and every key in it is optional; what is missing comes
from :data:`DEFAULTS` (the values CONTRACT.md section 2 lists). Validation is
done by the JSON Schema shipped in ``kandevd/schemas/config.json`` so that a
mistake is reported with the key path that holds it, e.g.
``queue.safety_interval_s: -1 is less than the minimum of 0``.

The resulting :class:`Config` is immutable and handed to components
explicitly; nothing in kandevd reads configuration from globals.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import yaml

DEFAULTS: dict[str, Any] = {
    "queue": {"safety_interval_s": 5, "max_claims_per_tick": 10, "stale_claim_s": 1800,
              "max_attempts": 6},
    "retry": {
        "max_retries": 4,
        "delays_s": [120, 600, 1800, 7200],
        "jitter": 0.25,
        "max_age_s": 86400,
    },
    "runtime": {"max_concurrent": 4, "stop_grace_s": 20, "adopt_on_restart": True,
                "keep_agents_on_stop": False},
    "control": {"idle_timeout_s": 60},
    "office": {"enabled": True, "interval_s": 30, "recovery_lookback_hours": 24},
    "scheduler": {"enabled": True, "root": None, "history_retention_days": 90},
    "agents": {"default": {"command": None, "timeout_s": 3600, "env": {}}},
}

DEFAULT_PROFILE: dict[str, Any] = DEFAULTS["agents"]["default"]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key path."""


class UnknownProfile(LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"agent profile {name!r} is not configured (configured: "
                         f"{', '.join(known)})")
        self.name = name


@dataclass(frozen=True)
class QueueConfig:
    safety_interval_s: float
    max_claims_per_tick: int
    stale_claim_s: float
    max_attempts: int = 6


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int
    delays_s: tuple[float, ...]
    jitter: float
    max_age_s: float


@dataclass(frozen=True)
class RuntimeConfig:
    max_concurrent: int
    stop_grace_s: float
    adopt_on_restart: bool = True
    keep_agents_on_stop: bool = False


@dataclass(frozen=True)
class ControlConfig:
    idle_timeout_s: float = 60.0


@dataclass(frozen=True)
class OfficeConfig:
    enabled: bool
    interval_s: float
    recovery_lookback_hours: float


@dataclass(frozen=True)
class SchedulerConfig:
    enabled: bool
    root: str | None
    history_retention_days: float
    disabled_via_env: bool = False
    configured_enabled: bool = True  # scheduler.enabled as the file says (env aside)


@dataclass(frozen=True)
class AgentProfile:
    """How an agent is executed. ``command`` None means the built-in echo agent."""

    name: str
    command: tuple[str, ...] | None
    timeout_s: float
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    queue: QueueConfig
    retry: RetryConfig
    runtime: RuntimeConfig
    office: OfficeConfig
    scheduler: SchedulerConfig
    agents: Mapping[str, AgentProfile]
    control: ControlConfig = ControlConfig()
    source: str | None = None

    def profile(self, name: str) -> AgentProfile:
        """The named agent profile.

        An agent whose profile was removed from the config must not quietly run
        something else: :class:`UnknownProfile` makes its attempt fail visibly.
        """
        try:
            return self.agents[name]
        except KeyError:
            raise UnknownProfile(name, sorted(self.agents)) from None


def _schema() -> dict[str, Any]:
    text = resources.files("kandevd.schemas").joinpath("config.json").read_text("utf-8")
    return json.loads(text)


def format_validation_error(error: jsonschema.ValidationError, prefix: str = "",
                            noun: str = "key") -> str:
    """``a.b.c: message`` for a jsonschema error; the root is named ``<root>``.

    An unknown key is reported at its own path (``queue.bogus: unknown key``),
    not at its parent's, so the message always names the offending key.
    """
    parts = [prefix] if prefix else []
    parts.extend(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict) \
            and error.validator_value is False:
        known = set(error.schema.get("properties", {}))
        unknown = sorted(str(k) for k in error.instance if k not in known)
        if unknown:
            where = ".".join([*parts, unknown[0]])
            allowed = ", ".join(sorted(known)) or "none"
            more = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            return f"{where}: unknown {noun}; allowed here: {allowed}{more}"
    where = ".".join(parts) or "<root>"
    return f"{where}: {error.message}"


def _deep_merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_keys(node: Any, path: tuple[str, ...] = ()) -> None:
    """YAML allows keys like ``true`` or ``1``; JSON Schema only sees string keys."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                where = ".".join(path) or "<root>"
                raise ConfigError(f"{where}: key {key!r} must be a string (quote it in YAML)")
            _check_keys(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _check_keys(value, (*path, str(index)))


def validate_document(document: Any) -> None:
    """Raise ConfigError for the first (most relevant) schema violation."""
    _check_keys(document)
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        best = jsonschema.exceptions.best_match(errors) or errors[0]
        raise ConfigError(format_validation_error(best))


def _env_scheduler_disabled(environ: Mapping[str, str]) -> bool:
    value = environ.get("SCHEDULER_ENABLED")
    return value is not None and value.strip().lower() in {"0", "false", "no", "off"}


def build_config(
    document: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Config:
    """Validate ``document`` (the parsed YAML, or None) and build the frozen Config."""
    environ = os.environ if environ is None else environ
    document = {} if document is None else document
    validate_document(document)
    merged = _deep_merge(DEFAULTS, document)
    agents: dict[str, AgentProfile] = {}
    for name, raw in merged["agents"].items():
        spec = _deep_merge(DEFAULT_PROFILE, raw)
        command = spec["command"]
        agents[name] = AgentProfile(
            name=name,
            command=tuple(command) if command is not None else None,
            timeout_s=float(spec["timeout_s"]),
            env=MappingProxyType(dict(spec["env"])),
        )
    disabled_via_env = _env_scheduler_disabled(environ)
    sched = merged["scheduler"]
    return Config(
        queue=QueueConfig(**merged["queue"]),
        retry=RetryConfig(**{**merged["retry"], "delays_s": tuple(merged["retry"]["delays_s"])}),
        runtime=RuntimeConfig(**merged["runtime"]),
        office=OfficeConfig(**merged["office"]),
        control=ControlConfig(idle_timeout_s=float(merged["control"]["idle_timeout_s"])),
        scheduler=SchedulerConfig(
            enabled=bool(sched["enabled"]) and not disabled_via_env,
            root=sched["root"],
            history_retention_days=sched["history_retention_days"],
            disabled_via_env=disabled_via_env,
            configured_enabled=bool(sched["enabled"]),
        ),
        agents=MappingProxyType(agents),
        source=source,
    )


def load_config(
    path: Path | None, *, home: Path | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Load ``path``, else ``<home>/kandevd.yaml`` when it exists, else the defaults."""
    if path is None and home is not None and (home / "kandevd.yaml").is_file():
        path = home / "kandevd.yaml"
    if path is None:
        return build_config(None, environ=environ)
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return build_config(document, environ=environ, source=str(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
