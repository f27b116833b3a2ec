"""The one rule for replaying a tool call's arguments where the API wants a JSON object
(Gemini's `functionCall.args` is a protobuf Struct, Anthropic's `tool_use.input` an object).

A model may send arguments that are no object: a JSON string, array or number, or text that is
no JSON. The loop answers such a call with a VALIDATION_ERROR; replaying the arguments as they
came would make the API refuse the whole next request (HTTP 400). So a replayed call carries:

* the object the loop read from the arguments (empty or `null` arguments: `{}`);
* otherwise `{"_raw_arguments": "<the arguments text as the model sent it>"}`, so the model
  still sees what it sent next to the error that answers it.

OpenAI-shaped APIs take `arguments` as a string and replay any text as it is.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from worker.codecs.openai_chat import decode_arguments
from worker.errors import ToolValidationError

RAW_ARGUMENTS_KEY = "_raw_arguments"


def arguments_text(value: Any) -> str:
    """A decoded JSON value (a wire's non-object `args`/`input`) -> the arguments text the
    canonical call carries (compact JSON, as the decoders write it)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def replay_object(arguments: Any) -> dict[str, Any]:
    """A call's arguments (an object, or the canonical arguments text) -> the object to
    replay. Text is read as the loop reads it (`decode_arguments`), so a call that ran replays
    what it ran with."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if arguments is None:
        return {}
    raw = arguments if isinstance(arguments, str) else arguments_text(arguments)
    try:
        return decode_arguments(raw)
    except (ToolValidationError, RecursionError):
        return {RAW_ARGUMENTS_KEY: raw}
