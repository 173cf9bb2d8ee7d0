"""A daemon with its gateway, and ``kandevd runner`` processes on their own homes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.support.daemon import DaemonProcess, fast_config, run_cli

#: The line a runner logs once the server accepted it.
RUNNER_READY = "serving http"


def gateway_config(dead_after_s: float = 30.0, **sections: dict[str, Any]) -> dict[str, Any]:
    return fast_config(gateway={"listen": "127.0.0.1:0", "dead_after_s": dead_after_s},
                       **sections)


def gateway_url(daemon: DaemonProcess) -> str:
    line = daemon.wait_for_line("gateway for runners at ")
    found = re.search(r"(https?://\S+)", line)
    assert found is not None, line
    return found.group(1)


def add_runner(daemon: DaemonProcess, folder: Path, name: str, *labels: str) -> Path:
    """Register ``name`` with the daemon's CLI; the token file (mode 0600) it printed."""
    args = ["runners", "add", name] + [item for label in labels for item in ("--label", label)]
    result = run_cli(daemon.home, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("kdr_"), result.stdout
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def runner_process(home: Path, server: str, token_file: Path,
                   profiles: dict[str, Any], *, slots: int = 2,
                   args: tuple[str, ...] = ()) -> DaemonProcess:
    """A ``kandevd runner`` (not started) with its own home and config."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    config = home / "runner.yaml"
    config.write_text(yaml.safe_dump({"runtime": {"max_concurrent": slots, "stop_grace_s": 5},
                                      "agents": profiles}))
    return DaemonProcess(home, None, command="runner", ready=RUNNER_READY,
                         args=["--server", server, "--token-file", str(token_file),
                               "--config", str(config), *args])
