"""The method registry: each control module adds its methods here.

A method is a handler ``handler(params) -> result`` plus the JSON Schema of
its params. The schema is checked before the handler runs, so handlers see
only well-typed params and an unknown parameter or a wrong type is always
-32602 with the offending path in the message.

A method that only reads (``reads``: every ``*.get`` and ``*.list``, and
what registers with ``reads=True``) runs inside :meth:`Registry.reading`,
the store's read connections (:meth:`kandevd.store.base.BaseStore.reading`), so
it never waits behind a write transaction. Writes inside it still go to the
writer; a misflagged method is slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import jsonschema

from kandevd.control.errors import domain_error
from kandevd.control.protocol import InvalidParams, MethodNotFound
from kandevd.formats.schemacheck import format_validation_error

Handler = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Method:
    name: str
    handler: Handler
    validator: jsonschema.Draft202012Validator
    allowed_while_stopping: bool = False
    summary: str = ""
    """One line for ``rpc.discover`` and ``kandevd methods``. Not taken from the
    handler's docstring: the registry built without a daemon (stand-in services)
    must describe the methods exactly as the daemon's does."""
    result: str = ""
    """What the method returns, in words (results have no schema)."""
    reads: bool = False
    """Only reads the store: served from the store's read connections."""
    empty_ok: bool = False
    """``{}`` is valid params (checked once at registration, not per request)."""
    quick_check: Callable[[dict[str, Any]], bool] | None = None
    """A check that accepts only params the schema accepts, in a fraction of its time:
    when it says True the schema is skipped (a hot method's common request)."""

    @property
    def schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = self.validator.schema  # type: ignore[assignment]
        return schema


def object_schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A closed params object: unknown members are rejected."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


MAX_OFFSET = 10**12
"""Far beyond any real table, and well inside SQLite's 64-bit integers."""


def paging_properties() -> dict[str, Any]:
    return {
        "limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50},
        "offset": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET, "default": 0},
    }


#: Names ending so are reads unless registered with ``reads=False``.
READ_SUFFIXES = (".get", ".list")

Reader = Callable[[], AbstractContextManager[Any]]


def _translating(handler: Handler) -> Handler:
    """``handler`` raising the domain's errors in the protocol's words (errors.py)."""

    def call(params: dict[str, Any]) -> Any:
        try:
            return handler(params)
        except Exception as exc:
            translated = domain_error(exc)
            if translated is None:
                raise
            raise translated from None

    call.__doc__ = handler.__doc__
    return call


class Registry:
    def __init__(self, reader: Reader | None = None) -> None:
        self._methods: dict[str, Method] = {}
        self.reader = reader
        """``Store.reading`` (given by the composition root); None: reads use the writer."""

    def add(self, name: str, handler: Handler, schema: dict[str, Any] | None = None, *,
            allowed_while_stopping: bool = False, summary: str = "",
            result: str = "", reads: bool | None = None,
            quick_check: Callable[[dict[str, Any]], bool] | None = None) -> None:
        if name in self._methods:
            raise ValueError(f"method {name!r} registered twice")
        schema = schema or object_schema({})
        jsonschema.Draft202012Validator.check_schema(schema)
        if reads is None:
            reads = name.endswith(READ_SUFFIXES)
        validator = jsonschema.Draft202012Validator(schema)
        self._methods[name] = Method(name, _translating(handler), validator,
                                     allowed_while_stopping, summary, result, reads,
                                     validator.is_valid({}), quick_check)

    def reading(self, method: Method) -> AbstractContextManager[Any]:
        """Where ``method`` runs: the store's read connections if it only reads."""
        if method.reads and self.reader is not None:
            return self.reader()
        return nullcontext()

    def get(self, name: str) -> Method:
        try:
            return self._methods[name]
        except KeyError:
            raise MethodNotFound(f"unknown method: {name}") from None

    def names(self) -> list[str]:
        return sorted(self._methods)

    def methods(self) -> list[Method]:
        """Every method, sorted by name."""
        return [self._methods[name] for name in self.names()]

    @staticmethod
    def check_params(method: Method, params: dict[str, Any]) -> None:
        if not params and method.empty_ok:
            return
        if method.quick_check is not None and method.quick_check(params):
            return
        errors = sorted(method.validator.iter_errors(params),
                        key=lambda e: [str(p) for p in e.absolute_path])
        if errors:
            # Every problem at once; best_match descends into each anyOf/oneOf error.
            messages: list[str] = []
            for error in errors:
                best = jsonschema.exceptions.best_match([error]) or error
                message = format_validation_error(best, prefix="params", noun="parameter")
                if message not in messages:
                    messages.append(message)
            raise InvalidParams("; ".join(messages))
        # JSON Schema counts 2.0 as an integer; hand handlers the int they expect
        # (every integer param has a maximum, so the value is small and exact).
        properties = method.validator.schema.get("properties", {})
        for name, value in params.items():
            if isinstance(value, float) and properties.get(name, {}).get("type") == "integer":
                params[name] = int(value)
