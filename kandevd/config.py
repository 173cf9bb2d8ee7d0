"""Configuration: ``kandevd.yaml`` + JSON Schema + environment -> a frozen Config.

Every key is optional (:data:`DEFAULTS` fills in); the JSON Schema in
``kandevd/schemas/config.json`` reports a mistake with the key path that holds
it (``queue.safety_interval_s: -1 is less than the minimum of 0.1``). The
:class:`Config` is immutable and handed to components explicitly.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema

from kandevd.cluster.timing import FenceTiming, fence_timing, fencing_problem
from kandevd.formats import yamlsafe
from kandevd.formats.schemacheck import format_validation_error
from kandevd.net.listen import GatewayConfig, ListenError, MetricsConfig, WebConfig, parse_listen
from kandevd.net.urls import POSTGRES_SCHEMES, redact_url

DEFAULTS: dict[str, Any] = {
    "store": {"url": None},
    "cluster": {"heartbeat_s": 2, "dead_after_s": 10, "fence_after_s": None,
                "on_partition": "fence"},
    "queue": {"safety_interval_s": 5, "max_claims_per_tick": 10, "stale_claim_s": 1800,
              "max_attempts": 6, "retention_days": 30},
    "retry": {
        "max_retries": 4,
        "delays_s": [120, 600, 1800, 7200],
        "jitter": 0.25,
        "max_age_s": 86400,
    },
    "runtime": {"max_concurrent": 4, "stop_grace_s": 20, "adopt_on_restart": True,
                "keep_agents_on_stop": False},
    "control": {"idle_timeout_s": 60, "event_buffer": 10000},
    "metrics": {"listen": None},
    "web": {"listen": None, "allowed_hosts": [], "tls_cert": None, "tls_key": None,
            "insecure_remote": False},
    "gateway": {"listen": None, "tls_cert": None, "tls_key": None, "insecure_remote": False,
                "dead_after_s": 30},
    "log": {"level": None},
    "office": {"enabled": True, "interval_s": 30, "recovery_lookback_hours": 24},
    "scheduler": {"enabled": True, "root": None, "history_retention_days": 90,
                  "notify": {"command": None, "webhook": None, "on": ["failure", "recovery"]}},
    "agents": {"default": {"command": None, "timeout_s": 3600, "env": {}}},
}

DEFAULT_PROFILE: dict[str, Any] = DEFAULTS["agents"]["default"]


class ConfigError(Exception):
    """A config that cannot be used, naming the key path; ``more``: its other problems."""

    def __init__(self, message: str, more: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.more = tuple(more)


class UnknownProfile(LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"agent profile {name!r} is not configured (configured: "
                         f"{', '.join(known)})")
        self.name = name


@dataclass(frozen=True)
class StoreConfig:
    """``store.url``: None = ``<home>/kandevd.db`` (SQLite); ``postgresql://...`` = shared.

    The URL may hold a password: print it only through :func:`redact_url`.
    """

    url: str | None = None

    def __repr__(self) -> str:
        return f"StoreConfig(url={redact_url(self.url) if self.url else None!r})"


@dataclass(frozen=True)
class ClusterConfig:
    """How daemons sharing a PostgreSQL store see each other (unused with SQLite).

    ``fence_after_s``: a daemon that completed no heartbeat this long stops its own
    agents (None: derived, see :func:`fence_timing`); ``on_partition``: ``fence``, or
    ``keep_running`` (at least once: a cut-off daemon's agents go on)."""

    heartbeat_s: float = 2.0
    dead_after_s: float = 10.0
    fence_after_s: float | None = None
    on_partition: str = "fence"

    @property
    def fencing(self) -> FenceTiming:
        return fence_timing(self.dead_after_s, self.fence_after_s)


def _check_store_url(url: str | None) -> None:
    if url is None:
        return
    from urllib.parse import urlsplit

    try:
        scheme = urlsplit(url).scheme if "://" in url else ""
    except ValueError:
        scheme = ""
    if scheme not in POSTGRES_SCHEMES:
        raise ConfigError(f"store.url: {redact_url(url)} is not a postgresql:// URL "
                          "(null keeps the SQLite database in the home)")


def _check_store_shape(document: Any) -> None:
    """``store`` and ``store.url`` of the wrong type, named without quoting the value.

    The schema's own message quotes the value, and a URL there may hold a password.
    """
    if not isinstance(document, Mapping) or "store" not in document:
        return
    store = document["store"]
    if not isinstance(store, Mapping):
        raise ConfigError("store: must be a mapping (store: {url: postgresql://...})")
    if "url" in store and store["url"] is not None and not isinstance(store["url"], str):
        raise ConfigError("store.url: must be a postgresql:// URL (a string) or null")


@dataclass(frozen=True)
class QueueConfig:
    safety_interval_s: float
    max_claims_per_tick: int
    stale_claim_s: float
    max_attempts: int = 6
    #: Terminal runs older than this many days are pruned with their files; 0 = keep.
    retention_days: float = 30


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
    #: Events a subscription holds for a client that reads slowly (events.subscribe).
    event_buffer: int = 10000


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
    #: ``SCHEDULER_ENABLED`` as set when it is neither on nor off (it turns cron off).
    unknown_env_switch: str | None = None
    configured_enabled: bool = True  # scheduler.enabled as the file says (env aside)
    #: ``{command, webhook, on}``: every schedule's notifications unless it has its own.
    notify: Mapping[str, Any] = field(default_factory=dict)


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
    metrics: MetricsConfig = MetricsConfig()  # noqa: RUF009 (frozen: shared safely)
    web: WebConfig = WebConfig()  # noqa: RUF009 (frozen: shared safely)
    gateway: GatewayConfig = GatewayConfig()  # noqa: RUF009 (frozen: shared safely)
    store: StoreConfig = StoreConfig()
    cluster: ClusterConfig = ClusterConfig()
    #: ``log.level``: the lowest level logged when ``serve --log-level`` is not
    #: given (None = INFO). The one setting SIGHUP applies without a restart.
    log_level: str | None = None
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


def _finite_number(checker: Any, instance: Any) -> bool:
    """JSON Schema's "number", without NaN and the infinities (YAML .nan, .inf, -.inf):
    ``minimum``/``maximum`` alone let NaN through, since every comparison with it is false."""
    base = jsonschema.Draft202012Validator.TYPE_CHECKER
    return base.is_type(instance, "number") and \
        not (isinstance(instance, float) and not math.isfinite(instance))


FiniteValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("number", _finite_number),
)


@cache
def _validator() -> Any:
    return FiniteValidator(_schema())


def _deep_merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_keys(document: Any) -> None:
    """YAML allows keys like ``true`` or ``1``; JSON Schema only sees string keys."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), document)]
    visited: set[int] = set()
    while stack:
        path, node = stack.pop()
        if not isinstance(node, (Mapping, list)) or id(node) in visited:
            continue
        visited.add(id(node))  # a part shared through a YAML alias is checked once
        if isinstance(node, Mapping):
            for key, value in node.items():
                if not isinstance(key, str):
                    where = ".".join(path) or "<root>"
                    raise ConfigError(f"{where}: key {key!r} must be a string "
                                      "(quote it in YAML)")
                stack.append(((*path, key), value))
        else:
            stack.extend(((*path, str(i)), value) for i, value in enumerate(node))


def _check_finite(document: Any) -> None:
    """NaN or an infinity anywhere is refused, with its key path (before the schema, whose
    own finite "number" type would say less)."""
    for path, value in yamlsafe.non_finite(document):
        where = ".".join(path) or "<root>"
        raise ConfigError(f"{where}: {yamlsafe.describe_non_finite(value)}")


def validate_document(document: Any) -> None:
    """Raise ConfigError for the first (most relevant) schema violation."""
    _check_keys(document)
    _check_finite(document)
    _check_store_shape(document)
    errors = sorted(_validator().iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        best = jsonschema.exceptions.best_match(errors) or errors[0]
        raise ConfigError(format_validation_error(best),
                          [format_validation_error(e) for e in errors if e is not best])


SWITCH_OFF = ("0", "false", "no", "off")
SWITCH_ON = ("1", "true", "yes", "on")


def _env_scheduler_switch(environ: Mapping[str, str]) -> tuple[bool, str | None]:
    """(``SCHEDULER_ENABLED`` turns cron off, the value when it is neither on nor off).

    A value that is neither (``flase``) turns it off too: it was set to say something,
    and a fire made by mistake cannot be taken back. Empty is as unset."""
    value = environ.get("SCHEDULER_ENABLED")
    word = (value or "").strip().lower()
    if not word or word in SWITCH_ON:
        return False, None
    return True, None if word in SWITCH_OFF else value


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
    disabled_via_env, unknown_switch = _env_scheduler_switch(environ)
    sched = merged["scheduler"]
    config = Config(
        queue=QueueConfig(**merged["queue"]),
        retry=RetryConfig(**{**merged["retry"], "delays_s": tuple(merged["retry"]["delays_s"])}),
        runtime=RuntimeConfig(**merged["runtime"]),
        office=OfficeConfig(**merged["office"]),
        control=ControlConfig(idle_timeout_s=float(merged["control"]["idle_timeout_s"]),
                              event_buffer=int(merged["control"]["event_buffer"])),
        metrics=MetricsConfig(listen=merged["metrics"]["listen"]),
        web=WebConfig(listen=merged["web"]["listen"],
                      allowed_hosts=tuple(merged["web"]["allowed_hosts"]),
                      tls_cert=merged["web"]["tls_cert"], tls_key=merged["web"]["tls_key"],
                      insecure_remote=bool(merged["web"]["insecure_remote"])),
        gateway=GatewayConfig(**{**merged["gateway"],
                                 "dead_after_s": float(merged["gateway"]["dead_after_s"])}),
        store=StoreConfig(url=merged["store"]["url"]),
        cluster=ClusterConfig(
            heartbeat_s=float(merged["cluster"]["heartbeat_s"]),
            dead_after_s=float(merged["cluster"]["dead_after_s"]),
            fence_after_s=None if merged["cluster"]["fence_after_s"] is None
            else float(merged["cluster"]["fence_after_s"]),
            on_partition=merged["cluster"]["on_partition"]),
        log_level=merged["log"]["level"].upper() if merged["log"]["level"] else None,
        scheduler=SchedulerConfig(
            enabled=bool(sched["enabled"]) and not disabled_via_env,
            root=sched["root"],
            history_retention_days=sched["history_retention_days"],
            disabled_via_env=disabled_via_env,
            unknown_env_switch=unknown_switch,
            configured_enabled=bool(sched["enabled"]),
            notify=MappingProxyType(dict(sched["notify"])),
        ),
        agents=MappingProxyType(agents),
        source=source,
    )
    check_config_finite(config)
    _check_store_url(config.store.url)
    if config.cluster.dead_after_s <= config.cluster.heartbeat_s:
        raise ConfigError(f"cluster.dead_after_s: {config.cluster.dead_after_s:g} must be more "
                          f"than cluster.heartbeat_s ({config.cluster.heartbeat_s:g})")
    if config.store.url is not None:  # (the cluster's timings matter on PostgreSQL only)
        problem = fencing_problem(config.cluster.heartbeat_s, config.cluster.dead_after_s,
                                  config.cluster.fence_after_s, config.cluster.on_partition)
        if problem is not None:
            raise ConfigError(problem)
    try:
        if config.metrics.listen is not None:
            parse_listen(config.metrics.listen)
        if config.web.listen is not None:
            parse_listen(config.web.listen, "web.listen", lowest_port=0)
        if config.gateway.listen is not None:
            parse_listen(config.gateway.listen, "gateway.listen", lowest_port=0)
        problem = config.web.problem() or config.gateway.problem()
    except ListenError as exc:
        raise ConfigError(str(exc)) from None
    if problem is not None:
        raise ConfigError(problem)
    return config


def check_config_finite(config: Config) -> None:
    """The check after loading: no number the daemon will use is NaN or infinite.

    The document was checked already; this guards the built values themselves
    (defaults, merges and conversions included), so a loop interval or a timeout
    can never be NaN whatever path built it.
    """
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {yamlsafe.describe_non_finite(value)}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for item in dataclasses.fields(value):
                if item.name not in ("name", "source"):
                    stack.append((f"{where}.{item.name}".lstrip("."), getattr(value, item.name)))
        elif isinstance(value, Mapping):
            stack.extend((f"{where}.{key}", item) for key, item in value.items())
        elif isinstance(value, (tuple, list)):
            stack.extend((f"{where}.{index}", item) for index, item in enumerate(value))


def load_config(
    path: Path | None, *, home: Path | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Load ``path``, else ``<home>/kandevd.yaml`` when it exists, else the defaults.

    Every way a file can be unusable is a ConfigError of one line that starts with
    the file's path: unreadable, a directory, not UTF-8, not YAML, an alias bomb,
    NaN or infinity, an unknown key, a wrong type.
    """
    # Whatever is there (a directory too) is the config: refused with its reason,
    # never silently taken for "no config".
    if path is None and home is not None and os.path.lexists(home / "kandevd.yaml"):
        path = home / "kandevd.yaml"
    if path is None:
        return build_config(None, environ=environ)
    try:
        document = yamlsafe.load_file(Path(path), "config")
    except yamlsafe.YamlError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return build_config(document, environ=environ, source=str(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", [f"{path}: {m}" for m in exc.more]) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None
