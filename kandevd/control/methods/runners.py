"""``runners.*``: the runners on other machines this daemon's gateway serves."""

from __future__ import annotations

from typing import Any

from kandevd.control.registry import Registry, object_schema
from kandevd.control.services import Services
from kandevd.gateway.directory import RunnerDirectory
from kandevd.runs.labels import LABELS_SCHEMA
from kandevd.store.runners import Runners
from kandevd.timeutil import utc_now

NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}(?!\n)$",
        "x-message": "is not allowed: use letters, digits, '.', '_' and '-', starting "
                       "with a letter or digit (at most 63 characters)"}


def register(registry: Registry, services: Services) -> None:
    directory = RunnerDirectory(Runners(services.store),
                                dead_after_s=services.config.gateway.dead_after_s)

    def add(params: dict[str, Any]) -> dict[str, Any]:
        return dict(directory.add(params["name"], params.get("labels", []), utc_now()))

    def remove(params: dict[str, Any]) -> dict[str, Any]:
        directory.remove(params["name"])
        return {"removed": params["name"]}

    def listed(_params: dict[str, Any]) -> dict[str, Any]:
        return {"items": directory.items(utc_now())}

    registry.add("runners.add", add,
                 object_schema({"name": NAME, "labels": LABELS_SCHEMA}, ("name",)),
                 summary="Register a runner; its token is in the answer, and nowhere else.",
                 result="{name, labels, token}")
    registry.add("runners.remove", remove, object_schema({"name": NAME}, ("name",)),
                 summary="Forget a runner: its token is refused from its next request on.",
                 result="{removed}")
    registry.add("runners.list", listed, object_schema({}), reads=True,
                 summary="Every runner: its labels, whether it is online, its running count.",
                 result="{items: [{name, labels, online, last_seen_at, running}]}")
