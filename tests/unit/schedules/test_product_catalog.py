"""product.yaml and users.yaml: every problem named, nothing dangerous loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kandevd.schedules.products import catalog


def write(root: Path, folder: str, text: str) -> Path:
    path = root / "products" / folder / "product.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD = """profile:
  runtime: {conversation: {mode: singleton}, agent_profile: fast}
  schedules:
    - {id: s, cron_expression: "0 8 * * *", messages: [hi]}
"""


def messages(root: Path) -> list[str]:
    return [str(p) for p in catalog.scan_products(root)[1]]


def test_a_good_product_loads_with_its_folder_as_profile_id(tmp_path: Path) -> None:
    write(tmp_path, "helper", GOOD)
    [product], problems = catalog.scan_products(tmp_path)
    assert problems == [] and product.profile_id == "helper"
    assert product.agent_profile == "fast" and [s.id for s in product.schedules] == ["s"]


@pytest.mark.parametrize(("text", "fragment"), [
    ("profile: [\n  x", "not valid YAML: line"),
    ("- just\n- a list\n", "<root>: ['just', 'a list'] is not of type 'object'"),
    ('profile: {id: "../x"}\n', "profile.id:"),
    ("profile:\n  schedules:\n    - {id: s, cron_expression: '0 8 * * *', messages: [m]}\n",
     "conversation.mode: must be 'singleton'"),
    ("profile:\n  runtime: {conversation: {mode: singleton}}\n  schedules:\n"
     "    - {id: s, cadence_hours: .nan, messages: [m]}\n", "holds .nan or .inf"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcd", "bcde", strict=True)),
     "expands to more than 100000 values"),
])
def test_bad_product_files_are_problems(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, "helper", text)
    [problem] = messages(tmp_path)
    assert problem.startswith(f"{path}: ") and fragment in problem


def test_two_folders_cannot_claim_one_profile(tmp_path: Path) -> None:
    write(tmp_path, "a", GOOD.replace("profile:\n", "profile:\n  id: same\n"))
    write(tmp_path, "b", GOOD.replace("profile:\n", "profile:\n  id: same\n"))
    [problem] = messages(tmp_path)
    assert "'same' is also the profile of" in problem


def test_no_directory_means_one_local_user_with_every_product(tmp_path: Path) -> None:
    users, problems = catalog.read_users(tmp_path)
    assert problems == [] and users == [catalog.LOCAL] and catalog.LOCAL.has("anything")


@pytest.mark.parametrize(("text", "fragment"), [
    ("{a: 1}\n", "must be a list of users"),
    ("- {id: ../x}\n", "[0].id:"),
    ("- {id: a}\n- {id: a}\n", "[1].id: 'a' is listed twice"),
    ("- {id: a, products: 3}\n", "[0].products:"),
    ("- {id: a, role: boss}\n", "[0].role:"),
    ("- {id: a, enabeld: false}\n", "[0].enabeld: unknown field; did you mean enabled?"),
    ("- {id: a, prodcts: [p]}\n", "[0].prodcts: unknown field; did you mean products?"),
    ("- {id: a, enable: false}\n", "[0].enable: unknown field; did you mean enabled?"),
])
def test_bad_user_directories_are_problems(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "users.yaml").write_text(text)
    users, problems = catalog.read_users(tmp_path)
    assert users is None and fragment in str(problems[0])


def test_a_users_other_fields_are_the_directorys_own(tmp_path: Path) -> None:
    """Fields kandevd does not read (a name, an email) are kept out of its way; only a
    known field mistyped is a problem (a typo of enabled must not leave a user on)."""
    (tmp_path / "users.yaml").write_text(
        "- {id: ann, name: Ann, email: a@x.org, uid: ann, _id: 7, projects: [x],"
        " enabled_at: 2026-01-01, product_ids: [p]}\n")
    users, problems = catalog.read_users(tmp_path)
    assert problems == [] and users is not None and [u.id for u in users] == ["ann"]


def test_who_has_a_product() -> None:
    assert catalog.User("a", products=("p",)).has("p")
    assert not catalog.User("a", products=("q",)).has("p")
    assert catalog.User("a", role="admin", products=()).has("p")


def test_a_repeated_schedule_id_is_said_with_the_files_other_problems(tmp_path: Path) -> None:
    write(tmp_path, "helper", """profile:
  runtime: {conversation: {mode: singleton}}
  schedules:
    - {id: a, cron_expression: "0 8 * * *", messages: [hi]}
    - {id: a, cron_expression: "0 9 * * *", messages: []}
""")
    found = messages(tmp_path)
    assert any("schedule 'a': id: used twice in this product" in p for p in found)
    assert any("messages" in p and "used twice" not in p for p in found)
    write(tmp_path, "helper", """profile:
  id: 5
  runtime: {conversation: {mode: singleton}}
  schedules:
    - {id: a, cron_expression: "0 8 * * *", messages: [hi]}
    - {id: a, cron_expression: "0 9 * * *", messages: [hi]}
""")
    found = messages(tmp_path)
    assert any("profile.id: 5 is not of type 'string'" in p for p in found)
    assert any("schedule 'a': id: used twice in this product" in p for p in found)


def test_a_fifo_product_or_user_file_is_a_problem_never_opened(tmp_path: Path) -> None:
    """A FIFO nobody writes would block the cron loop's reload (and validate) for ever:
    it is named as not a regular file, without being opened."""
    product = tmp_path / "products" / "helper" / "product.yaml"
    product.parent.mkdir(parents=True)
    os.mkfifo(product)
    [problem] = messages(tmp_path)
    assert problem == f"{product}: cannot read: not a regular file (a FIFO, a socket or a " \
        "device)"
    users = tmp_path / "users.yaml"
    os.mkfifo(users)
    found, problems = catalog.read_users(tmp_path)
    assert found is None and [str(p) for p in problems] == [
        f"{users}: cannot read: not a regular file (a FIFO, a socket or a device)"]
