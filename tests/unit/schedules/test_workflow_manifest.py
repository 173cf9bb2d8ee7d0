"""Workflow manifests: validation names workflow, schedule and field; writes keep the rest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.schedules.workflows import manifest
from kandevd.schedules.workflows.manifest import ManifestError, ManifestUnusable
from tests.support.workflows import schedule, write_workflow


def problems_of(root: Path) -> list[str]:
    return [str(p) for p in manifest.scan(root)[1]]


def test_a_valid_workflow_loads_normalized(tmp_path: Path) -> None:
    write_workflow(tmp_path, "reports", [schedule(mode="workflow", workshop_mode="runner",
                                                  timezone="Europe/Paris")],
                   id="rep", label="Reports", agent_profile="fast", pending_upgrades=[1])
    workflows, problems = manifest.scan(tmp_path)
    assert problems == []
    [workflow] = workflows
    assert (workflow.name, workflow.manifest_id, workflow.label) == ("reports", "rep", "Reports")
    assert workflow.agent_profile == "fast" and workflow.pending_upgrades
    [sched] = workflow.schedules
    assert (sched.mode, sched.workshop_mode, sched.timezone) == ("workshop", "run",
                                                                 "Europe/Paris")
    assert sched.overlap_policy == "skip" and sched.enabled and sched.messages == ()
    assert workflow.aliases == {"reports", "rep"}


@pytest.mark.parametrize(("bad", "expected"), [
    ({"cron_expression": "0 9 * * *", "group_ids": ["g1"]},
     "schedules[0]: id: required field missing"),
    (schedule(cron="0 9 * *"), "schedule 'daily': cron_expression: '0 9 * *' is not a valid"
                               " 5-field cron expression"),
    (schedule(cron="0 25 * * *"), "schedule 'daily': cron_expression:"),
    (schedule(timezone="Mars/Olympus"), "schedule 'daily': timezone: unknown time zone "
                                        "'Mars/Olympus'"),
    (schedule(group_ids=[]), "schedule 'daily': group_ids: at least one group is required "
                             "(available: g1)"),
    (schedule(group_ids=["g1", "nope"]), "schedule 'daily': group_ids: unknown group(s) "
                                         "'nope' (available: g1)"),
    (schedule(overlap_policy="queue_all"), "schedule 'daily': overlap_policy:"),
    (schedule(enabled="yes"), "schedule 'daily': enabled: 'yes' is not of type 'boolean'"),
    (schedule(notify={"webhook": "http://"}), "schedule 'daily': notify.webhook: 'http://' is "
                                              "not an http:// or https:// URL with a host"),
])
def test_bad_schedules_are_rejected_naming_file_schedule_and_field(
        tmp_path: Path, bad: dict, expected: str) -> None:
    folder = write_workflow(tmp_path, "reports", [bad])
    found = problems_of(tmp_path)
    assert len(found) == 1
    assert found[0].startswith(f"{folder / 'workflow.json'}: ")
    assert expected in found[0]


def test_a_duplicate_schedule_id_is_rejected(tmp_path: Path) -> None:
    write_workflow(tmp_path, "w", [schedule("a"), schedule("a")])
    [problem] = problems_of(tmp_path)
    assert "schedule 'a': id: used twice in this workflow" in problem
    write_workflow(tmp_path, "w", [schedule("a"), schedule("a", jitter_s=-1)])
    found = problems_of(tmp_path)  # every problem of the file at once
    assert any("schedule 'a': id: used twice in this workflow" in p for p in found)
    assert any("jitter_s" in p for p in found)


def test_one_bad_schedule_keeps_the_whole_workflow_out_but_others_load(tmp_path: Path) -> None:
    write_workflow(tmp_path, "bad", [schedule("ok"), schedule("tz", timezone="No/Where")])
    write_workflow(tmp_path, "good", [schedule("ok")])
    (tmp_path / "Workflow" / "broken").mkdir()
    (tmp_path / "Workflow" / "broken" / "workflow.json").write_text("{ nope")
    workflows, problems = manifest.scan(tmp_path)
    assert [w.name for w in workflows] == ["good"]
    assert len(problems) == 2
    assert any("broken/workflow.json: not valid JSON" in str(p) for p in problems)


def test_a_folder_with_an_unsafe_name_is_reported(tmp_path: Path) -> None:
    write_workflow(tmp_path, "has space", [schedule()])
    [problem] = problems_of(tmp_path)
    assert "workflow name 'has space' is not allowed" in problem


@given(st.text(min_size=1, max_size=20))
def test_workflow_names_never_escape_the_workflow_root(name: str) -> None:
    try:
        manifest.check_workflow_name(name)
    except ManifestError:
        return
    assert "/" not in name and "\\" not in name and "\0" not in name
    assert name not in {".", ".."}
    root = Path("/r")
    assert (root / "Workflow" / name).resolve().parent == root / "Workflow"


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "", "x" * 129])
def test_path_like_names_are_refused(name: str) -> None:
    with pytest.raises(ManifestError, match="is not allowed"):
        manifest.check_workflow_name(name)


@pytest.mark.parametrize("schedule_id", ["../h1", "x/y", "a b", "h:1", "..", ".hidden",
                                         "-x", "x" * 201])
def test_schedule_ids_that_would_break_a_job_id_are_refused_in_words(schedule_id: str) -> None:
    # (A job id is "workflow:<workflow>:<schedule>": a ':' or '/' would make it ambiguous,
    # and the console's link to the job would not lead back to it.)
    with pytest.raises(ManifestError, match="is not allowed: use letters, digits"):
        manifest.parse_schedule(schedule(schedule_id), None)


@pytest.mark.parametrize("schedule_id", ["daily", "Daily-2", "a.b_c", "9am", "x" * 200])
def test_ordinary_schedule_ids_load(schedule_id: str) -> None:
    assert manifest.parse_schedule(schedule(schedule_id), None).id == schedule_id


@given(st.sets(st.sampled_from(["a", "b", "c", "d"]), min_size=1),
       st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=4,
                unique=True))
def test_group_ids_load_exactly_when_every_group_exists(defined: set[str],
                                                        chosen: list[str]) -> None:
    groups = dict.fromkeys(defined, True)
    raw = schedule(group_ids=chosen)
    if set(chosen) <= defined:
        assert manifest.parse_schedule(raw, groups).group_ids == tuple(chosen)
    else:
        with pytest.raises(ManifestError) as info:
            manifest.parse_schedule(raw, groups)
        assert f"available: {', '.join(sorted(defined))}" in str(info.value)


def test_edit_schedules_changes_only_the_schedules(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule("a")], owner="team",
                            capabilities={"tools": ["x"]}, pending_upgrades=["v2"])
    workflow = manifest.edit_schedules(folder, lambda s: [*s, schedule("b")])
    assert [s.id for s in workflow.schedules] == ["a", "b"]
    document = json.loads((folder / "workflow.json").read_text())
    assert document["owner"] == "team" and document["capabilities"] == {"tools": ["x"]}
    assert document["pending_upgrades"] == ["v2"]


def test_a_misspelt_schedule_field_is_a_problem_with_its_suggestion(tmp_path: Path) -> None:
    """Manifest keys outside ``schedules`` are the workflow's own; a schedule's are
    kandevd's, so a typo there would silently run with the default (UTC)."""
    folder = write_workflow(tmp_path, "w", [schedule("a", timzone="Europe/Paris", colour=1),
                                            {"cron_expression": "@daily", "group_ids": ["g1"]},
                                            schedule("c", timezone="Europe/Pariss")],
                            owner="team")
    workflow, problems = manifest.load_workflow(folder)
    assert workflow is None
    assert [p.message for p in problems] == [
        "schedule 'a': colour: unknown field; allowed here: " + ", ".join(sorted(
            manifest.SCHEDULE_FIELDS))
        + "; schedule 'a': timzone: unknown field; did you mean timezone?",
        "schedules[1]: id: required field missing",
        "schedule 'c': timezone: unknown time zone 'Europe/Pariss'; did you mean Europe/Paris?",
    ]


def test_an_invalid_edit_writes_nothing(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule("a")])
    before = (folder / "workflow.json").read_bytes()
    with pytest.raises(ManifestError, match="timezone: unknown time zone"):
        manifest.edit_schedules(folder, lambda s: [*s, schedule("b", timezone="Nope/Nope")])
    assert (folder / "workflow.json").read_bytes() == before


def test_a_manifest_that_does_not_parse_is_never_rewritten(tmp_path: Path) -> None:
    folder = tmp_path / "Workflow" / "w"
    folder.mkdir(parents=True)
    (folder / "workflow.json").write_text("{half")
    with pytest.raises(ManifestUnusable, match="never rewrites it"):
        manifest.edit_schedules(folder, lambda s: [*s, schedule("b")])
    assert (folder / "workflow.json").read_text() == "{half"
    assert sorted(p.name for p in folder.iterdir()) == ["workflow.json", "workflow.json.lock"]


@pytest.mark.parametrize(("name", "text", "key"), [
    ("workflow.json", '{"note": "first", "schedules": [{"id": "s", "cron_expression": '
     '"0 3 * * *", "group_ids": ["g1"]}], "note": "second", "schedules": []}', "note"),
    ("workflow.json", '{"schedules": [{"id": "s", "enabled": false, "cron_expression": '
     '"0 3 * * *", "group_ids": ["g1"], "enabled": true}]}', "enabled"),
    ("variables/variables.json", '{"variables": [], "variables": [], "groups": []}',
     "variables"),
])
def test_a_key_given_twice_is_a_problem_and_the_file_is_never_rewritten(
        tmp_path: Path, name: str, text: str, key: str) -> None:
    """A hand edit that says a key twice: JSON readers keep the second silently (a
    schedule ``enabled: false`` then ``true`` would run), and a rewrite would drop the
    first. Refused as a problem, edits answer that it must be fixed first."""
    folder = write_workflow(tmp_path, "w", [schedule("a")])
    (folder / name).write_text(text)
    [problem] = problems_of(tmp_path)
    assert f"key {key!r} appears twice in one object" in problem, problem
    with pytest.raises(ManifestUnusable):
        manifest.edit_schedules(folder, lambda s: [*s, schedule("b")])
    assert (folder / name).read_text() == text


def test_the_demo_workflows_load_without_a_problem() -> None:
    demo = Path(__file__).resolve().parents[3] / "kandevd" / "examples" / "demo" / "workspace"
    workflows, problems = manifest.scan(demo)
    assert problems == [] and workflows
    assert any(s.cron_expression == "* * * * *" for w in workflows for s in w.schedules)


def test_a_lone_surrogate_escape_is_a_problem_not_a_schedule(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [])
    (folder / "workflow.json").write_text(
        '{"schedules": [{"id": "s\\ud800", "cron_expression": "* * * * *", '
        '"group_ids": ["g1"]}]}')
    [problem] = problems_of(tmp_path)
    assert "lone surrogate \\ud800" in problem


@pytest.mark.parametrize("manifest_extra", [{"id": 42}, {"agent_profile": "../x"},
                                            {"schedules": None}, {"schedules": {"a": 1}},
                                            {"schedules": "abc"}])
def test_an_edit_never_rewrites_a_manifest_that_is_wrong_apart_from_its_schedules(
        tmp_path: Path, manifest_extra: dict) -> None:
    folder = write_workflow(tmp_path, "w", [])
    document = {"schedules": [], **manifest_extra}
    (folder / "workflow.json").write_text(json.dumps(document))
    before = (folder / "workflow.json").read_bytes()
    with pytest.raises(ManifestUnusable, match="fix the file first"):
        manifest.edit_schedules(folder, lambda s: [*s, schedule("n")])
    assert (folder / "workflow.json").read_bytes() == before


def test_a_broken_variables_file_is_the_one_problem_reported(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule()])
    (folder / "variables" / "variables.json").write_text("{nope")
    [problem] = problems_of(tmp_path)
    assert problem.startswith(str(folder / "variables" / "variables.json"))


def test_a_group_defined_twice_is_said_with_the_files_other_problems(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule()])
    (folder / "variables" / "variables.json").write_text(json.dumps({
        "variables": [{"name": "topic"}],
        "groups": [{"group_id": "g1", "display_name": "G", "values": {"topic": "x"}},
                   {"group_id": "g1", "display_name": 5, "values": {"topic": "y"}}]}))
    found = problems_of(tmp_path)
    assert any("groups: group_id 'g1' is defined twice" in p for p in found)
    assert any("display_name: 5 is not of type 'string'" in p for p in found)


def test_edits_go_through_a_symlink_and_keep_the_file_mode(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule("a")])
    real = tmp_path / "elsewhere.json"
    (folder / "workflow.json").rename(real)
    real.chmod(0o644)
    (folder / "workflow.json").symlink_to(real)
    manifest.edit_schedules(folder, lambda s: [*s, schedule("b")])
    assert (folder / "workflow.json").is_symlink()
    assert [s["id"] for s in json.loads(real.read_text())["schedules"]] == ["a", "b"]
    assert real.stat().st_mode & 0o777 == 0o644


def test_a_second_name_for_a_workflow_folder_is_not_loaded_twice(tmp_path: Path) -> None:
    """A link to a workflow's folder beside it would be a second workflow sharing its
    history and run folders (two sessions in one folder): a problem instead. A link to a
    folder elsewhere is a workflow as any other."""
    write_workflow(tmp_path, "wfl", [schedule("s")])
    (tmp_path / "Workflow" / "wfl2").symlink_to(tmp_path / "Workflow" / "wfl")
    elsewhere = write_workflow(tmp_path / "other", "far", [schedule("t")])
    (tmp_path / "Workflow" / "linked").symlink_to(elsewhere)
    workflows, problems = manifest.scan(tmp_path)
    assert sorted(w.name for w in workflows) == ["linked", "wfl"]
    [problem] = [str(p) for p in problems]
    assert "wfl2" in problem and "the same folder as" in problem
    assert "not loaded twice" in problem


def test_special_files_and_an_unreadable_root_are_problems_not_hangs(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "fifo", [])
    (folder / "workflow.json").unlink()
    os.mkfifo(folder / "workflow.json")
    [problem] = problems_of(tmp_path)
    assert "not a regular file" in problem
    other = tmp_path / "other"
    other.mkdir()
    (other / "Workflow").write_text("a file where a folder belongs")
    workflows, problems = manifest.scan(other)
    assert workflows == [] and "cannot read" in str(problems[0])


def test_state_files_of_the_wrong_shape_are_reported_untouched(tmp_path: Path) -> None:
    folder = write_workflow(tmp_path, "w", [schedule()])
    (folder / "schedule-runs.json").write_text('{"not": "a list"}')
    (folder / "decisions.json").write_text("[broken")
    problems = [str(p) for p in manifest.state_file_problems(tmp_path)]
    assert len(problems) == 2
    assert (folder / "decisions.json").read_text() == "[broken"
