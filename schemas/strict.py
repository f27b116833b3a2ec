"""Strict marshmallow fields the spec schemas and the fleet's configuration share: JSON's types as
they are, no coercion of "yes" or "3" (the configuration's with its own messages)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from marshmallow import ValidationError, fields, validate

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


# the fleet's configuration's (schemas/config.py), each with its one-line message


class ConfigBool(fields.Field[bool]):
    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> bool:
        if not isinstance(value, bool):
            raise ValidationError("must be true or false")
        return value


class ConfigInt(fields.Field[int]):
    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValidationError("must be an integer")
        return value


class Seconds(fields.Field[float]):
    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValidationError("must be a number of seconds")
        if not math.isfinite(value) or value <= 0:
            raise ValidationError("must be a positive number of seconds")
        return float(value)


def positive() -> validate.Range:
    return validate.Range(min=1, error="must be at least 1")
