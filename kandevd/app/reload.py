"""SIGHUP: rescan the workflow and product files, re-read the config's log level.

Everything else in the config is built into running parts (the store, the
runtime's slots, the loops' intervals), so a change there is named in the
log as needing a restart rather than half-applied.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from kandevd.app.logsetup import current_level, set_level
from kandevd.config import Config, ConfigError, load_config
from kandevd.schedules.loop import CronLoop
from kandevd.sdnotify import SystemdNotifier
from kandevd.store.backend import backend_problem

log = logging.getLogger("kandevd.daemon")


def reload(config: Config, cron: CronLoop, *, config_path: Path | None, home: Path,
           log_level_fixed: bool, systemd: SystemdNotifier) -> Config:
    """Ask the cron loop to rescan, apply what can be applied; the config now in force."""
    log.info("received SIGHUP: reloading workflow and product files")
    cron.request_reload()
    config = _reload_config(config, config_path=config_path, home=home,
                            log_level_fixed=log_level_fixed)
    systemd.status("reloaded workflow and product files")
    return config


def _reload_config(config: Config, *, config_path: Path | None, home: Path,
                   log_level_fixed: bool) -> Config:
    try:
        fresh = load_config(config_path, home=home)
    except ConfigError as exc:
        log.warning("SIGHUP: config not reloaded, the running one stays: %s", exc)
        return config
    problem = backend_problem(fresh)
    if problem is not None:  # what the next start would refuse (exit 78)
        log.warning("SIGHUP: config not reloaded, the running one stays: %s: %s",
                    fresh.source or "config", problem)
        return config
    wanted = fresh.log_level or "INFO"
    if log_level_fixed:
        if fresh.log_level is not None and wanted != current_level():
            log.warning("SIGHUP: log.level %s ignored: serve --log-level %s wins",
                        wanted, current_level())
    elif wanted != current_level():
        set_level(wanted)
        log.warning("SIGHUP: log level is now %s", wanted)
    changed = config_changes(config, fresh)
    if changed:
        log.warning("SIGHUP: changes to %s need a restart", ", ".join(changed))
    return dataclasses.replace(config, log_level=fresh.log_level)


def config_changes(running: Config, fresh: Config) -> list[str]:
    """The settings that differ between two configs, ``log.level`` and the file aside.

    Named by section (``queue``, ``runtime``, ...) and, for agent profiles, by
    ``agents.<name>``: what SIGHUP reports as needing a restart.
    """
    changed: list[str] = []
    for item in dataclasses.fields(Config):
        if item.name in ("log_level", "source", "agents"):
            continue
        if getattr(running, item.name) != getattr(fresh, item.name):
            changed.append(item.name)
    for name in sorted(set(running.agents) | set(fresh.agents)):
        if running.agents.get(name) != fresh.agents.get(name):
            changed.append(f"agents.{name}")
    return changed
