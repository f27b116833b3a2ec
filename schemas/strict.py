"""Strict marshmallow fields the spec schemas share: JSON's types as they are, no coercion of
"yes" or "3" (the fleet's configuration has its own, with its own messages)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marshmallow import fields

FUNCTION_NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}\Z"


class StrictBool(fields.Field[bool]):
    """Only JSON true/false: marshmallow's Boolean also takes 1, "yes", "on", ..."""

    default_error_messages = {"invalid": "Not a valid boolean."}

    def _deserialize(
        self, value: Any, attr: str | None, data: Mapping[str, Any] | None, **kwargs: Any
    ) -> bool:
        if value is True or value is False:
            return value
        raise self.make_error("invalid")


def strict_int(**kwargs: Any) -> fields.Integer:
    # strict: 3.7 and "3" are errors rather than silently becoming 3.
    return fields.Integer(strict=True, **kwargs)
