"""The method registry: each control module adds its methods here.

A method is a handler ``handler(params) -> result`` plus the JSON Schema of
its params. The schema is checked before the handler runs, so handlers see
only well-typed params and an unknown parameter or a wrong type is always
-32602 with the offending path in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from kandevd.config import format_validation_error
from kandevd.control.protocol import InvalidParams, MethodNotFound

Handler = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Method:
    name: str
    handler: Handler
    validator: jsonschema.Draft202012Validator
    allowed_while_stopping: bool = False


def object_schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A closed params object: unknown members are rejected."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


MAX_OFFSET = 10**12
"""Far beyond any real table, and well inside SQLite's 64-bit integers."""


def paging_properties() -> dict[str, Any]:
    return {
        "limit": {"type": "integer", "minimum": 1, "maximum": 500},
        "offset": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET},
    }


class Registry:
    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}

    def add(self, name: str, handler: Handler, schema: dict[str, Any] | None = None, *,
            allowed_while_stopping: bool = False) -> None:
        if name in self._methods:
            raise ValueError(f"method {name!r} registered twice")
        schema = schema or object_schema({})
        jsonschema.Draft202012Validator.check_schema(schema)
        self._methods[name] = Method(name, handler, jsonschema.Draft202012Validator(schema),
                                     allowed_while_stopping)

    def method(self, name: str, schema: dict[str, Any] | None = None, **kwargs: Any
               ) -> Callable[[Handler], Handler]:
        def decorate(handler: Handler) -> Handler:
            self.add(name, handler, schema, **kwargs)
            return handler
        return decorate

    def get(self, name: str) -> Method:
        try:
            return self._methods[name]
        except KeyError:
            raise MethodNotFound(f"unknown method: {name}") from None

    def names(self) -> list[str]:
        return sorted(self._methods)

    @staticmethod
    def check_params(method: Method, params: dict[str, Any]) -> None:
        errors = sorted(method.validator.iter_errors(params), key=lambda e: list(e.absolute_path))
        if errors:
            error = jsonschema.exceptions.best_match(errors) or errors[0]
            raise InvalidParams(format_validation_error(error, prefix="params", noun="parameter"))
        # JSON Schema counts 2.0 as an integer; hand handlers the int they expect
        # (every integer param has a maximum, so the value is small and exact).
        properties = method.validator.schema.get("properties", {})
        for name, value in params.items():
            if isinstance(value, float) and properties.get(name, {}).get("type") == "integer":
                params[name] = int(value)
