"""Products and users under the workflow root: ``products/<dir>/product.yaml``, ``users.yaml``.

A product (an agent with its own chat surface) declares recurring jobs under
``profile.schedules``; its profile id is ``profile.id``, else the folder name.
A profile with schedules must talk in one conversation per user
(``profile.runtime.conversation.mode: singleton``). ``users.yaml``, when present,
is the user directory ``[{id, enabled, role?: admin|member, products?: [..] | "*"}]``
(without ``products`` a user has every product); when it is absent there is one
local user, ``local``, who has every product.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from kandevd.formats.schemacheck import validation_problems
from kandevd.formats.yamlsafe import YamlError
from kandevd.formats.yamlsafe import load_file as load_yaml
from kandevd.schedules.products import schedule as product_schedule
from kandevd.schedules.products.schedule import ProductSchedule
from kandevd.schedules.workflows.manifest import ManifestError, Problem, check_workflow_name

PRODUCTS_DIR = "products"
PRODUCT_FILE = "product.yaml"
USERS_FILE = "users.yaml"
#: The fields of a user directory entry kandevd reads.
USER_KEYS = ("id", "enabled", "role", "products")
LOCAL_USER = "local"


@dataclass(frozen=True)
class Product:
    profile_id: str
    folder: Path
    agent_profile: str
    schedules: tuple[ProductSchedule, ...]


@dataclass(frozen=True)
class User:
    id: str
    enabled: bool = True
    role: str = "member"
    products: tuple[str, ...] | str = "*"

    def has(self, profile_id: str) -> bool:
        return self.role == "admin" or self.products == "*" or profile_id in self.products


LOCAL = User(LOCAL_USER)


@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("kandevd.schemas").joinpath("product.json").read_text("utf-8")
    schema = json.loads(text)
    # Schedules are checked one by one (products.schedule.validate) to name each.
    schedules = schema.get("properties", {}).get("profile", {}).get("properties", {}) \
        .get("schedules")
    if isinstance(schedules, dict):
        schedules["items"] = {"type": "object"}
    return jsonschema.Draft202012Validator(schema)


def _json_safe(document: Any) -> Any:
    """YAML may hold dates, non-string keys or NaN; JSON Schema and files may not."""
    try:
        return json.loads(json.dumps(document, default=str, allow_nan=False))
    except ValueError:
        raise YamlError("holds .nan or .inf, which is not a number kandevd can use") from None


def load_product(folder: Path) -> tuple[Product | None, list[Problem]]:
    path = folder / PRODUCT_FILE
    if not os.path.lexists(path):
        return None, [Problem(str(path), "missing: a product folder needs a product.yaml")]
    try:
        document = _json_safe(load_yaml(path, regular_only=True))
    except (YamlError, ValueError) as exc:
        return None, [Problem(str(path), str(exc))]
    found = validation_problems(_validator(), document, noun="field")
    if found:
        found += _repeated_ids(document)
        return None, [Problem(str(path), message) for message in found]
    profile = document.get("profile") or {}
    profile_id = profile.get("id") or folder.name
    problems = []
    try:
        check_workflow_name(profile_id)
    except ManifestError as exc:
        problems.append(f"profile.id: {str(exc).replace('workflow name', 'profile id')}")
    raw_schedules = profile.get("schedules") or []
    mode = ((profile.get("runtime") or {}).get("conversation") or {}).get("mode")
    if raw_schedules and mode != "singleton":
        problems.append(f"profile.runtime.conversation.mode: must be 'singleton' when the "
                        f"profile has schedules (found {mode!r})")
    schedules = []
    problems += _repeated_ids(document)
    for index, raw in enumerate(raw_schedules):
        name = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) \
            else f"schedules[{index}]"
        found = product_schedule.validate(raw)
        if found:
            problems += [f"schedule {name!r}: {p}" for p in found]
            continue
        schedules.append(product_schedule.parse(raw))
    if problems:
        return None, [Problem(str(path), p) for p in problems]
    agent = (profile.get("runtime") or {}).get("agent_profile") or "default"
    return Product(profile_id, folder, agent, tuple(schedules)), []


def _repeated_ids(document: Any) -> list[str]:
    """A problem for each schedule id given again, whatever else is wrong (so that every
    problem of the file is said at once)."""
    profile = document.get("profile") if isinstance(document, dict) else None
    raw = profile.get("schedules") if isinstance(profile, dict) else None
    seen: set[str] = set()
    repeated: list[str] = []
    for item in raw if isinstance(raw, list) else []:
        given = item.get("id") if isinstance(item, dict) else None
        if isinstance(given, str):
            if given in seen:
                repeated.append(f"schedule {given!r}: id: used twice in this product")
            seen.add(given)
    return repeated


def product_folder_count(root: Path) -> int:
    """How many product folders the root has (0 when ``products/`` cannot be read)."""
    try:
        return sum(1 for p in (root / PRODUCTS_DIR).iterdir() if p.is_dir())
    except OSError:
        return 0


def scan_products(root: Path) -> tuple[list[Product], list[Problem]]:
    """Every product folder's product.yaml; the problems are labelled ``product``."""
    products, problems = _scan_products(root)
    return products, [dataclasses.replace(p, kind="product") for p in problems]


def _scan_products(root: Path) -> tuple[list[Product], list[Problem]]:
    base = root / PRODUCTS_DIR
    try:
        folders = sorted((p for p in base.iterdir() if p.is_dir()), key=lambda p: p.name)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [Problem(str(base), f"cannot read: {exc.strerror or exc}")]
    products: list[Product] = []
    problems: list[Problem] = []
    owners: dict[str, Path] = {}
    for folder in folders:
        product, found = load_product(folder)
        problems += found
        if product is None:
            continue
        if product.profile_id in owners:
            problems.append(Problem(str(folder / PRODUCT_FILE), f"profile.id: "
                                    f"{product.profile_id!r} is also the profile of "
                                    f"{owners[product.profile_id]}"))
            continue
        owners[product.profile_id] = folder
        products.append(product)
    return products, problems


def read_users(root: Path) -> tuple[list[User] | None, list[Problem]]:
    """The user directory; ``[LOCAL]`` when there is none, None when it is unusable
    (every problem at once, labelled ``users``)."""
    users, problems = _read_users(root)
    return users, [dataclasses.replace(p, kind="users") for p in problems]


def _read_users(root: Path) -> tuple[list[User] | None, list[Problem]]:
    path = root / USERS_FILE
    if not os.path.lexists(path):
        return [LOCAL], []
    try:
        document = _json_safe(load_yaml(path, regular_only=True))
    except (YamlError, ValueError) as exc:
        return None, [Problem(str(path), str(exc))]
    if not isinstance(document, list):
        return None, [Problem(str(path), "must be a list of users")]
    users: list[User] = []
    problems: list[str] = []
    seen: set[str] = set()
    for index, raw in enumerate(document):
        user, found = _user(raw, f"[{index}]")
        problems += found
        if user is None:
            continue
        if user.id in seen:
            problems.append(f"[{index}].id: {user.id!r} is listed twice")
            continue
        seen.add(user.id)
        users.append(user)
    if problems:
        return None, [Problem(str(path), p) for p in problems]
    return users, []


def _mistyped(key: str) -> str | None:
    """``enabled`` or ``products`` when ``key`` is one of them mistyped (``enabeld``,
    ``enable``, ``prodcts``): a typo there would leave a user on, or give every product.
    Other fields (``uid``, ``projects``, ``enabled_at``) are the directory's own."""
    if key in USER_KEYS:
        return None
    for known in ("enabled", "products"):
        if not key.startswith(known) and \
                difflib.SequenceMatcher(None, key.lower(), known).ratio() >= 0.85:
            return known
    return None


def _user(raw: Any, where: str) -> tuple[User | None, list[str]]:
    """One directory entry and every problem it has. A member without ``products`` is
    unrestricted (every product), as an admin is; ``products: []`` means none."""
    if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
        return None, [f"{where}: a user is an object with a string id"]
    problems = []
    try:
        check_workflow_name(raw["id"])
    except ManifestError as exc:
        problems.append(f"{where}.id: {str(exc).replace('workflow name', 'user id')}")
    products = raw.get("products", "*")
    if not (products == "*" or (isinstance(products, list)
                                and all(isinstance(p, str) for p in products))):
        problems.append(f"{where}.products: a list of profile ids or \"*\"")
    role = raw.get("role", "member")
    if role not in ("admin", "member"):
        problems.append(f"{where}.role: {role!r} is not one of admin, member")
    if not isinstance(raw.get("enabled", True), bool):
        problems.append(f"{where}.enabled: must be true or false")
    for key in raw:  # (other keys are the directory's own, but not these two mistyped)
        near = _mistyped(str(key))
        if near is not None:
            problems.append(f"{where}.{key}: unknown field; did you mean {near}?")
    if problems:
        return None, problems
    return User(raw["id"], raw.get("enabled", True), role,
                products if products == "*" else tuple(products)), []
