"""Product schedules through the real daemon and real files (tests/support/agents/recorder.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kandevd.control.client import RpcCallError
from tests.support.daemon import DaemonProcess, run_cli
from tests.support.workflows import recorder_config, records

pytestmark = pytest.mark.integration

JOB = "product:helper:brief"


def write_product(root: Path, schedules: list[dict[str, Any]], profile: str = "helper") -> Path:
    folder = root / "products" / profile
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "product.yaml").write_text(yaml.safe_dump({"profile": {
        "id": profile, "runtime": {"conversation": {"mode": "singleton"}},
        "schedules": schedules}}))
    return folder / "product.yaml"


def brief(**fields: Any) -> dict[str, Any]:
    return {"id": "brief", "cron_expression": "0 8 * * *", "timezone": "Europe/Paris",
            "messages": ["one", "two"], **fields}


def finished(daemon: DaemonProcess, job_id: str, user: str | None = None, count: int = 1
             ) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"id": job_id, **({"user_id": user} if user else {})}

    def done() -> list[dict[str, Any]] | None:
        items = daemon.call("scheduler.jobs.runs", params)["items"]
        ok = len(items) >= count and all(e["status"] != "running" for e in items)
        return items if ok and not daemon.call("scheduler.jobs.get", params)["running"] \
            else None
    return daemon.wait_until(done, what=f"finished runs of {job_id}")


@pytest.fixture
def product_home(tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]
                 ) -> Callable[..., tuple[DaemonProcess, Path]]:
    def make(schedules: list[dict[str, Any]], users: list[dict[str, Any]] | None = None
             ) -> tuple[DaemonProcess, Path]:
        home = tmp_path / "home"
        write_product(home / "workspace", schedules)
        if users is not None:
            (home / "workspace" / "users.yaml").write_text(yaml.safe_dump(users))
        record = tmp_path / "record.jsonl"
        return daemon_factory(recorder_config(record), home=home), record
    return make


def test_product_jobs_are_listed_read_only_and_run_in_the_conversation(product_home) -> None:
    daemon, record = product_home([brief(), brief(id="fails", messages=["FAIL now", "never"])])
    listed = daemon.call("scheduler.jobs.list", {"entity_type": "product"})
    assert [(j["id"], j["user_id"]) for j in listed["items"]] == [
        ("product:helper:brief", "local"), ("product:helper:fails", "local")]
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["entity_type"] == "product" and job["last_status"] is None
    assert job["next_run_at"] is not None  # decided at start, not run: nothing fires
    for method in ("scheduler.jobs.update", "scheduler.jobs.delete"):
        params: dict[str, Any] = {"id": JOB}
        if method.endswith("update"):
            params["schedule"] = {"name": "x"}
        with pytest.raises(RpcCallError) as info:
            daemon.call(method, params)
        assert info.value.error["data"]["kind"] == "refused"
        assert "product.yaml" in info.value.error["message"]

    answer = daemon.call("scheduler.jobs.trigger", {"id": JOB})
    [entry] = finished(daemon, JOB)
    assert entry["status"] == "success" and entry["trigger_source"] == "manual"
    seen = records(record)
    assert [r["stdin"]["message"] for r in seen] == ["one", "two"]
    assert seen[0]["end"] <= seen[1]["start"]
    stdin = seen[0]["stdin"]
    assert (stdin["product"], stdin["user_id"], stdin["schedule_id"]) == ("helper", "local",
                                                                         "brief")
    assert stdin["conversation"] == {"mode": "singleton", "session_id": answer["session_id"]}
    chats = daemon.home / "workspace" / "_users" / "local" / "Chats" / "helper"
    assert seen[0]["cwd"] == str(chats)
    conversation = json.loads((chats / "conversation.json").read_text())
    assert conversation["session_id"] == answer["session_id"]
    state = json.loads((daemon.home / "workspace" / "_users" / "local" / "chat_history" /
                        "product-schedules.json").read_text())
    assert state["schedules"]["helper:brief"]["last_status"] == "success"
    assert state["schedules"]["helper:brief"]["run_count"] == 1

    daemon.call("scheduler.jobs.trigger", {"id": "product:helper:fails"})
    [failed] = finished(daemon, "product:helper:fails")
    assert failed["status"] == "error" and len(failed["turns"]) == 1
    # the same conversation for every schedule of the product
    assert failed["session_id"] == answer["session_id"]


def test_an_override_survives_a_restart_and_product_yaml_is_untouched(product_home) -> None:
    daemon, _ = product_home([brief()])
    product_file = daemon.home / "workspace" / "products" / "helper" / "product.yaml"
    before = product_file.read_bytes()
    assert daemon.call("scheduler.jobs.disable", {"id": JOB})["enabled"] is False
    assert daemon.stop() == 0
    daemon.start()
    job = daemon.call("scheduler.jobs.get", {"id": JOB})
    assert job["enabled"] is False and job["cron_eligible"] is False
    assert product_file.read_bytes() == before


def test_a_user_directory_decides_who_gets_the_product(product_home) -> None:
    daemon, _ = product_home([brief()], users=[
        {"id": "ann", "enabled": True, "products": ["helper"]},
        {"id": "bob", "enabled": False, "products": "*"},
        {"id": "cy", "enabled": True, "products": ["other"]},
        {"id": "dee", "enabled": True, "role": "admin", "products": []},
    ])
    items = daemon.call("scheduler.jobs.list", {"entity_type": "product"})["items"]
    assert sorted(j["user_id"] for j in items) == ["ann", "dee"]
    with pytest.raises(RpcCallError) as info:
        daemon.call("scheduler.jobs.get", {"id": JOB})
    assert info.value.error["code"] == -32602 and "user_id" in info.value.error["message"]
    daemon.call("scheduler.jobs.trigger", {"id": JOB, "user_id": "ann"})
    with pytest.raises(RpcCallError) as busy:
        daemon.call("scheduler.jobs.trigger", {"id": JOB, "user_id": "ann"})
    assert busy.value.error["data"]["kind"] == "already_running"
    [entry] = finished(daemon, JOB, "ann")
    assert entry["user_id"] == "ann"
    assert daemon.call("scheduler.jobs.runs", {"id": JOB, "user_id": "dee"})["total"] == 0


def test_history_is_capped_at_200_entries(product_home) -> None:
    daemon, _ = product_home([brief(messages=["one"])])
    chats = daemon.home / "workspace" / "_users" / "local" / "Chats" / "helper"
    old = [{"id": f"old{i}", "schedule_id": "brief", "status": "success"} for i in range(200)]
    chats.mkdir(parents=True, exist_ok=True)
    (chats / "schedule-runs.json").write_text(json.dumps(old))
    daemon.call("scheduler.jobs.trigger", {"id": JOB})
    entries = finished(daemon, JOB)
    stored = json.loads((chats / "schedule-runs.json").read_text())
    assert len(stored) == 200 and stored[0]["id"] == entries[0]["id"]
    assert stored[-1]["id"] == "old198"


def test_validate_reports_a_broken_product_yaml_with_its_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = home / "workspace" / "products" / "bad"
    folder.mkdir(parents=True)
    (folder / "product.yaml").write_text("profile:\n  schedules: [\n  - id: x\n")
    other = home / "workspace" / "products" / "nocadence"
    write_product(home / "workspace", [{"id": "y", "messages": ["m"]}], profile="nocadence")
    result = run_cli(home, "validate")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith(str(folder / "product.yaml")) and "line" in line
               for line in lines)
    assert any(line.startswith(str(other / "product.yaml")) and "timing" in line
               for line in lines)
