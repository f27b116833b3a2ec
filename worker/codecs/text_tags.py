"""The `<tool_call>` text-tag protocol ("openai-text-tags"), conformance B6. Pure: no I/O.

For OpenAI-compatible servers without native tool calling: the chat-completions endpoint, no
`tools` field; a system prompt (Hermes/Qwen style) lists the tools and teaches the model to
answer with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and results
come back as `<tool_response>` blocks in a user turn (B6.64).

Reading a reply (`decode`, and the stream's `result()`, which parses the same final text):
- Native `tool_calls` from the server win; the content is then left alone.
- Every `<tool_call>` block outside code fences and `<think>` is a call, in order (B6.56);
  a tag right after a backtick (inline code: "the `<tool_call>` tag") is prose.
  A block is parsed as JSON, then as a Python literal (single quotes, B6.57); no bracket
  repair, as a block is complete text; a fence inside the tag is stripped (B6.59);
  `parameters` is read like `arguments`, string arguments are kept as text, extra keys are
  ignored (B6.61); a JSON list of calls in one block gives each.
- A block that stays unreadable is NOT dropped and NOT shown as text: it becomes a call the
  loop answers with an `invalid_arguments` (or `unknown_tool`) error result, so the model
  sees that its call failed and why, while the valid blocks run (B6.57). Its name is read
  from the raw text when possible (else `invalid_tool_call`); its arguments are the raw text,
  whose JSON error the loop reports (with a NUL appended when the loop's B1.2 repair would
  otherwise turn a cut-off block into an object).
- A `<tool_call>` left open at the end counts when the rest is one complete object (B6.60).
- `<think>...</think>` (or a leading `...</think>` whose opening tag the chat template wrote)
  goes to `reasoning_content`; calls written inside it are not executed, they are noted there
  (B6.62). Text before, between and after blocks is the content; everything from a
  `<tool_response>` the model wrote itself on is dropped (B6.63).
- Call ids are synthesised by `normalize_completion` (`call_<24 hex>`, deterministic), and
  `finish_reason` becomes `tool_calls`. The turn keeps its tag text in
  `_provider["openai-text-tags"]` so a replay shows the model exactly what it wrote.
- With `tool_choice: "none"` or no tools, `<tool_call>` blocks are plain text.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from worker.codecs.openai_chat import decode_arguments, normalize_completion, tool_message_content
from worker.codecs.openai_codec import OpenAICodec
from worker.codecs.openai_stream import OpenAIStreamAssembler
from worker.codecs.protocol import ChatRequest, Delta, SseEvent, ToolChoice, WireRequest
from worker.errors import ToolArgumentsError

PROTOCOL = "openai-text-tags"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
FENCE = "```"
INVALID_CALL_NAME = "invalid_tool_call"
_MAX_LITERAL_CHARS = 100_000  # ast.literal_eval is kept to block-sized text
_TOKENS = re.compile(r"```|<tool_call>|<think>|</think>|<tool_response>")
_CALL_IN_THINK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_NAME = re.compile(r"""["']name["']\s*:\s*["']([^"'\\]{1,200})["']""")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Requests


class TextTagCodec:
    protocol = PROTOCOL

    def __init__(self) -> None:
        self._openai = OpenAICodec()

    def encode(self, request: ChatRequest) -> WireRequest:
        """The OpenAI body with no `tools`: tools in the system prompt, calls and results as
        tags in content (stop sequences are left to the params)."""
        plain = replace(
            request,
            messages=render_messages(request),
            tools=[],
            tool_choice=None,
            parallel_tool_calls=None,
        )
        return self._openai.encode(plain)

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        return apply_text_tags(normalize_completion(body), _parses_calls(request))

    def assembler(self, request: ChatRequest) -> TextTagAssembler:
        return TextTagAssembler(_parses_calls(request))

    def retry_after_s(self, status: int, body: Any) -> float | None:
        return None


def _parses_calls(request: ChatRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def tool_prompt(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool | None) -> str:
    """The system-prompt section that teaches the tags (A table, text-tag column)."""
    lines = []
    for tool in tools:
        fn = tool.get("function") or tool
        entry: dict[str, Any] = {"name": fn.get("name")}
        if fn.get("description"):
            entry["description"] = fn["description"]
        entry["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    if parallel is False:
        several = "call at most one function per turn"
    else:
        several = "to call several functions at once, write several blocks"
    if choice == "required":
        rule = "You must call at least one function in this turn."
    elif isinstance(choice, dict) and choice.get("name"):
        rule = f'You must call the function "{choice["name"]}" in this turn, and no other.'
    else:
        rule = "Call a function only when it helps; otherwise answer directly."
    return "\n".join(
        [
            "# Tools",
            "",
            "You can call functions. They are listed inside <tools></tools>, one JSON object"
            " per line with the function's name, description and JSON schema of its arguments:",
            "<tools>",
            *lines,
            "</tools>",
            "",
            "To call a function, write its name and arguments as one JSON object inside"
            " <tool_call></tool_call> tags:",
            CALL_OPEN,
            '{"name": "<function-name>", "arguments": {<arguments as a JSON object>}}',
            CALL_CLOSE,
            f"Write one <tool_call> block per call; {several}. After your calls, stop and"
            " wait: each result comes back in a user message inside"
            " <tool_response></tool_response> tags. Never write <tool_response> yourself.",
            rule,
        ]
    )


def render_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The transcript without native tool fields: one merged system message first, assistant
    calls as `<tool_call>` blocks, tool results as `<tool_response>` blocks in one user turn
    per run of tool messages, in call order (B6.64)."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the responses
    responses: dict[str, Any] | None = None  # the user turn collecting consecutive results
    for message in request.messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_text(message.get("content")))
            continue
        if role in ("tool", "function"):  # function: the legacy result role (B1.14)
            block = _response_block(message, names)
            if responses is None:
                responses = {"role": "user", "content": block}
                out.append(responses)
            else:
                responses["content"] += "\n" + block
            continue
        responses = None
        if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
            out.append(_assistant_with_calls(message, names))
        else:
            out.append(dict(message))
    if _parses_calls(request):
        system.append(tool_prompt(request.tools, request.tool_choice, request.parallel_tool_calls))
    text = "\n\n".join(t for t in system if t)
    return [{"role": "system", "content": text}, *out] if text else out


def _assistant_with_calls(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    calls = message.get("tool_calls") or [{"function": message["function_call"]}]
    for call in calls:
        fn = call.get("function") or {}
        if isinstance(call.get("id"), str):
            names[call["id"]] = str(fn.get("name") or "")
    own = message.get("_provider")
    verbatim = own.get(PROTOCOL) if isinstance(own, dict) else None
    if isinstance(verbatim, dict) and isinstance(verbatim.get("content"), str):
        content = verbatim["content"]  # the turn exactly as the model wrote it
    else:
        parts = [_text(message.get("content"))] + [_call_block(c) for c in calls]
        content = "\n".join(p for p in parts if p)
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "function_call")}
    out["content"] = content
    return out


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    elif args is None:
        args = {}
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _response_block(message: dict[str, Any], names: dict[str, str]) -> str:
    name = message.get("name") or names.get(str(message.get("tool_call_id")), "")
    content = message.get("content")
    text = _text(content) if isinstance(content, list) else tool_message_content(content)
    body = json.dumps({"name": name, "content": text}, ensure_ascii=False)
    return f"{RESPONSE_OPEN}\n{body}\n{RESPONSE_CLOSE}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


# ---------------------------------------------------------------------------------------------
# Replies


@dataclass
class ParsedText:
    content: str = ""  # text outside tags, stripped
    calls: list[dict[str, Any]] = field(default_factory=list)  # raw calls, ids left to normalise
    reasoning: list[str] = field(default_factory=list)  # <think> spans
    calls_in_reasoning: list[str] = field(default_factory=list)  # names, never executed
    replay: str = ""  # the visible text with its tags, for a verbatim replay
    changed: bool = False  # False: the text has no tag to act on


def parse_text(text: str, parse_calls: bool = True) -> ParsedText:
    """Split a reply's content into preamble text, calls and reasoning (B6.56-63)."""
    out = ParsedText()
    visible: list[str] = []  # content pieces
    replay: list[str] = []  # content pieces and raw blocks
    pos = 0
    while (match := _TOKENS.search(text, pos)) is not None:
        token, start = match.group(), match.start()
        if token == FENCE:  # B6.59: a fenced example is literal text, tags and all
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
        if token == RESPONSE_OPEN:  # B6.63: a result the model made up; nothing after counts
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
        if isinstance(value, str):  # a double-encoded block, as B1.4 sees in arguments
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
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")  # B6.61
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
    # The loop answers with the text's own JSON error. Its B1.2 repair would close a cut-off
    # block into an object (the whole {"name", "arguments"} wrapper): a NUL, never valid
    # JSON, defeats it and keeps the parser's message; an array is the last resort.
    for arguments in (raw, raw + "\x00", _compact([raw])):
        try:
            decode_arguments(arguments)
        except ToolArgumentsError:
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
        out["choices"][0]["message"]["_provider"] = {PROTOCOL: {"content": parsed.replay}}
    return out


# ---------------------------------------------------------------------------------------------
# Streams


class TextTagAssembler:
    """B6.58: OpenAI chunks; content Deltas show only text outside tags, never a half tag
    (a suffix that may open one is held back), `<think>` text as reasoning. `result()` parses
    the final content exactly like `decode`."""

    def __init__(self, parse_calls: bool = True) -> None:
        self._inner = OpenAIStreamAssembler()
        self._parse_calls = parse_calls
        self._view = VisibleText(parse_calls)

    @property
    def finished(self) -> bool:
        return self._inner.finished

    def feed(self, event: SseEvent) -> list[Delta]:
        out: list[Delta] = []
        for delta in self._inner.feed(event):
            out.extend(self._view.push(delta.text) if delta.kind == "content" else [delta])
        if self._inner.finished:
            out.extend(self._view.flush())
        return out

    def result(self) -> dict[str, Any]:
        return apply_text_tags(self._inner.result(), self._parse_calls)


_CLOSERS = {"call": CALL_CLOSE, "think": THINK_CLOSE, "fence": FENCE}
_SHOWN_AS: dict[str, str | None] = {"text": "content", "fence": "content", "think": "reasoning"}


class VisibleText:
    """Streamed content -> display Deltas: fenced text shown, tool calls and made-up
    responses hidden, reasoning routed apart. Display only: the result never depends on it."""

    def __init__(self, parse_calls: bool = True) -> None:
        self._mode = "text"  # text | call | think | fence | cut
        self._held = ""
        self._last = ""  # the last character shown: a backtick makes `<tool_call>` prose
        self._openers = {FENCE: "fence", THINK_OPEN: "think", RESPONSE_OPEN: "cut"}
        if parse_calls:
            self._openers[CALL_OPEN] = "call"

    def push(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        buf = self._held + text
        self._held = ""
        while buf and self._mode != "cut":
            if self._mode == "text":
                hits = [(i, t) for t in self._openers if (i := buf.find(t)) >= 0]
                if not hits:
                    keep = _partial_suffix(buf, tuple(self._openers))
                    self._emit(out, buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                i, tag = min(hits)
                if tag == CALL_OPEN and (buf[i - 1] if i else self._last) == "`":
                    self._emit(out, buf[: i + len(tag)])
                    buf = buf[i + len(tag) :]
                    continue
                self._emit(out, buf[:i] + (tag if tag == FENCE else ""))
                self._mode, buf = self._openers[tag], buf[i + len(tag) :]
                continue
            closer = _CLOSERS[self._mode]
            j = buf.find(closer)
            if j < 0:
                keep = _partial_suffix(buf, (closer,))
                self._emit(out, buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            self._emit(out, buf[:j] + (closer if self._mode == "fence" else ""))
            self._mode, buf = "text", buf[j + len(closer) :]
        return out

    def flush(self) -> list[Delta]:
        out: list[Delta] = []
        if self._mode != "cut":
            self._emit(out, self._held)
        self._held = ""
        return out

    def _emit(self, out: list[Delta], text: str) -> None:
        kind = _SHOWN_AS.get(self._mode)
        if text and kind == "content":
            out.append(Delta("content", text))
            self._last = text[-1]
        elif text and kind == "reasoning":
            out.append(Delta("reasoning", text))


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could begin one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best
