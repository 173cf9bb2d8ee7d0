"""``daemon.*``: status and shutdown."""

from __future__ import annotations

from typing import Any

from kandevd.control.registry import Registry, object_schema
from kandevd.services import Services


def register(registry: Registry, services: Services) -> None:
    def status(_params: dict[str, Any]) -> dict[str, Any]:
        return services.status()

    def shutdown(_params: dict[str, Any]) -> dict[str, Any]:
        services.request_shutdown()
        return {}

    registry.add("daemon.status", status, object_schema({}), allowed_while_stopping=True)
    registry.add("daemon.shutdown", shutdown, object_schema({}))
