"""``daemon.*``: status and shutdown; ``rpc.discover``: the OpenRPC document."""

from __future__ import annotations

from typing import Any

from kandevd.control import openrpc
from kandevd.control.registry import Registry, object_schema
from kandevd.control.services import Services


def register(registry: Registry, services: Services) -> None:
    def status(_params: dict[str, Any]) -> dict[str, Any]:
        return services.status()

    def shutdown(_params: dict[str, Any]) -> dict[str, Any]:
        services.request_shutdown()
        return {}

    def discover(_params: dict[str, Any]) -> dict[str, Any]:
        return openrpc.discover(registry)

    registry.add("daemon.status", status, object_schema({}), allowed_while_stopping=True,
                 reads=True,
                 summary="The daemon's state, loops, store, run counts and scheduler. "
                         "`runtime.active` counts the agent executions started and not yet "
                         "recorded (a slot a queue pass holds while it looks for work is "
                         "not one).",
                 result="{version, pid, state, started_at, home, boot_id, loops, runtime: "
                        "{active, max_concurrent, keeper?}, "
                        "store: {statements, status, reason?, db: {size_bytes, oldest_run_at, "
                        "retention_days}}, runs, scheduler, ...}")
    registry.add("daemon.shutdown", shutdown, object_schema({}),
                 summary="Start a graceful shutdown (running requests finish first).",
                 result="{}")
    def metrics(_params: dict[str, Any]) -> str:
        return services.metrics_text()

    registry.add("daemon.metrics", metrics, object_schema({}), reads=True,
                 summary="The Prometheus text exposition of the daemon's metrics.",
                 result="string (the Prometheus text format)")
    registry.add("rpc.discover", discover, object_schema({}), reads=True,
                 summary="Every method and its params, as an OpenRPC document.",
                 result="{openrpc, info, methods}")
