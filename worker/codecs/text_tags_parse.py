"""Reading a `<tool_call>` text-tag reply ("openai-text-tags"): the tag vocabulary, and the
rules shared by `decode` and the stream's `result()`, which parses the same final text.
Pure: no I/O.

- Native `tool_calls` from the server win; the content is then left alone.
- Every `<tool_call>` block outside code fences and `<think>` is a call, in order; a tag
  in a fence is an example, and a tag right after a backtick (inline code: "the `<tool_call>`
  tag") is prose. A block is parsed as JSON, then as a Python literal (single quotes, common
  since the Hermes prompt shows them); no bracket repair, as a block is complete text; a fence
  inside the tag is stripped; `parameters` is read like `arguments`, string arguments are
  kept as text, extra keys are ignored; a JSON list of calls in one block gives each.
- A block that stays unreadable is NOT dropped and NOT shown as text: it becomes a call the
  loop answers with an `invalid_arguments` (or `unknown_tool`) error result, so the model
  sees that its call failed and why, while the valid blocks run (one bad block must not turn
  the whole reply into text). Its name is read from the raw text when possible (else
  `invalid_tool_call`); its arguments are the raw text, whose JSON error the loop reports
  (with a NUL appended when the loop's repair of truncated arguments would otherwise turn a
  cut-off block into an object).
- A `<tool_call>` left open at the end counts when the rest is one complete object.
- `<think>...</think>` (or a leading `...</think>` whose opening tag the chat template wrote)
  goes to `reasoning_content`; calls written inside it are not executed, they are noted there
  so none is lost silently. Text before, between and after blocks is the content; everything
  from a `<tool_response>` the model wrote itself on is dropped (a result it made up).
- Call ids are synthesised by `normalize_completion` (`call_<24 hex>`, deterministic), and
  `finish_reason` becomes `tool_calls`. The turn keeps its tag text in
  `_provider["openai-text-tags"]` so a replay shows the model exactly what it wrote.
- With `tool_choice: "none"` or no tools, `<tool_call>` blocks are plain text.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from schemas.protocols import TEXT_TAGS
from schemas.spec_types import INVALID_CALL_NAME
from worker.codecs.openai_chat import decode_arguments, normalize_completion
from worker.codecs.protocol import kept_for_replay
from worker.errors import ToolValidationError

PROTOCOL = TEXT_TAGS.name
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
FENCE = "```"
_MAX_LITERAL_CHARS = 100_000  # ast.literal_eval is kept to block-sized text
_TOKENS = re.compile(r"```|<tool_call>|<think>|</think>|<tool_response>")
_CALL_IN_THINK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_NAME = re.compile(r"""["']name["']\s*:\s*["']([^"'\\]{1,200})["']""")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass
class ParsedText:
    content: str = ""  # text outside tags, stripped
    calls: list[dict[str, Any]] = field(default_factory=list)  # raw calls, ids left to normalise
    reasoning: list[str] = field(default_factory=list)  # <think> spans
    calls_in_reasoning: list[str] = field(default_factory=list)  # names, never executed
    replay: str = ""  # the visible text with its tags, for a verbatim replay
    changed: bool = False  # False: the text has no tag to act on


def parse_text(text: str, parse_calls: bool = True) -> ParsedText:
    """Split a reply's content into preamble text, calls and reasoning."""
    out = ParsedText()
    visible: list[str] = []  # content pieces
    replay: list[str] = []  # content pieces and raw blocks
    pos = 0
    while (match := _TOKENS.search(text, pos)) is not None:
        token, start = match.group(), match.start()
        if token == FENCE:  # a fenced example is literal text, tags and all
            end = text.find(FENCE, match.end())
            stop = len(text) if end < 0 else end + len(FENCE)
            visible.append(text[pos:stop])
            replay.append(text[pos:stop])
            pos = stop
            continue
        literal_call = token == CALL_OPEN and (not parse_calls or text[start - 1 : start] == "`")
        if literal_call or (token == THINK_CLOSE and pos > 0):  # `<tool_call>` is prose
            visible.append(text[pos : match.end()])
            replay.append(text[pos : match.end()])
            pos = match.end()
            continue
        visible.append(text[pos:start])
        replay.append(text[pos:start])
        out.changed = True
        if token == RESPONSE_OPEN:  # a result the model made up; nothing after counts
            pos = len(text)
            break
        if token == THINK_CLOSE:  # the template opened <think>: all so far was reasoning
            visible.pop()
            replay.pop()
            _reasoning(out, text[:start], parse_calls)
            pos = match.end()
        elif token == THINK_OPEN:
            end = text.find(THINK_CLOSE, match.end())
            _reasoning(out, text[match.end() : len(text) if end < 0 else end], parse_calls)
            pos = len(text) if end < 0 else end + len(THINK_CLOSE)
        else:
            end = text.find(CALL_CLOSE, match.end())
            closed = end >= 0
            body = text[match.end() : end if closed else len(text)]
            pos = end + len(CALL_CLOSE) if closed else len(text)
            out.calls.extend(parse_block(body))
            replay.append(text[start:pos])
    visible.append(text[pos:])
    replay.append(text[pos:])
    out.content = "".join(visible).strip()
    out.replay = "".join(replay).strip()
    return out


def _reasoning(out: ParsedText, span: str, parse_calls: bool) -> None:
    out.reasoning.append(span.strip())
    for block in _CALL_IN_THINK.findall(span) if parse_calls else []:
        found = _NAME.search(block)
        out.calls_in_reasoning.append(found.group(1) if found else INVALID_CALL_NAME)


def parse_block(body: str) -> list[dict[str, Any]]:
    """One `<tool_call>` body -> its call(s); an unreadable body -> one call the loop rejects."""
    text = _strip_fence(body.strip())
    value = _load(text)
    if isinstance(value, dict):
        return [_call(value, text)]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_call(v, _compact(v)) for v in value]  # a JSON list of calls in one block
    return [_invalid_call(text, parsed=value is not None)]


def _strip_fence(text: str) -> str:
    if not text.startswith(FENCE):
        return text
    text = text[len(FENCE) :]
    first_nl = text.find("\n")
    if first_nl >= 0 and text[:first_nl].strip().isalnum():  # an info string: ```json
        text = text[first_nl + 1 :]
    return text.removesuffix(FENCE).strip()


def _load(text: str) -> Any:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        pass
    else:
        if isinstance(value, str):  # a double-encoded block, as arguments sometimes are
            try:
                return json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                return None
        return value
    if len(text) <= _MAX_LITERAL_CHARS:
        try:
            value = ast.literal_eval(text)  # the Hermes prompt shows Python-style dicts
            json.dumps(value)  # a set, bytes or tuple key is no JSON: unreadable
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        return value
    return None


def _call(obj: dict[str, Any], raw: str) -> dict[str, Any]:
    if not isinstance(obj.get("name"), str) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # an OpenAI-shaped call written as text
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _invalid_call(raw, parsed=True)
    # `parameters` is a common variant of `arguments`
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        arguments = "{}"
    elif isinstance(args, str):
        arguments = args  # decoded (and checked) by the loop like any string arguments
    else:
        arguments = _compact(args)
    return {"type": "function", "function": {"name": name.strip(), "arguments": arguments}}


def _invalid_call(raw: str, parsed: bool) -> dict[str, Any]:
    found = None if parsed else _NAME.search(raw)
    name = (found.group(1).strip() if found else "") or INVALID_CALL_NAME
    # The loop answers with the text's own JSON error. Its repair of truncated arguments would
    # close a cut-off block into an object (the whole {"name", "arguments"} wrapper): a NUL,
    # never valid JSON, defeats it and keeps the parser's message; an array is the last resort.
    for arguments in (raw, raw + "\x00", _compact([raw])):
        try:
            decode_arguments(arguments)
        except ToolValidationError:
            break
        except RecursionError:
            continue  # the loop could not read it either: the next candidate
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def apply_text_tags(completion: dict[str, Any], parse_calls: bool = True) -> dict[str, Any]:
    """A canonical completion whose content holds tags -> one with calls and reasoning."""
    choice = completion["choices"][0]
    message = choice["message"]
    content = message.get("content")
    if message.get("tool_calls") or not isinstance(content, str):
        return completion
    parsed = parse_text(content, parse_calls)
    if not parsed.changed:
        return completion
    new: dict[str, Any] = {**message, "content": parsed.content or None}
    if parsed.calls:
        new["tool_calls"] = parsed.calls
    reasoning = [message.get("reasoning_content") or "", *parsed.reasoning]
    if parsed.calls_in_reasoning:
        names = ", ".join(parsed.calls_in_reasoning)
        reasoning.append(
            f"[{len(parsed.calls_in_reasoning)} <tool_call> block(s) inside <think> were"
            f" not executed: {names}]"
        )
    if any(reasoning):
        new["reasoning_content"] = "\n\n".join(r for r in reasoning if r)
    out = normalize_completion({**completion, "choices": [{**choice, "message": new}]})
    if parsed.calls:
        out["choices"][0]["message"]["_provider"] = kept_for_replay(TEXT_TAGS, parsed.replay)
    return out
