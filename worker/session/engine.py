"""The pure session engine: the auto tool-call loop of guest-abi.md section 4.

No Celery, Redis, HTTP or wasmtime here. Given what a session has stored so far (its spec
and, per round, the model reply and the tool outcomes), `plan` says what happens next:
call the model, run these tools, or finish with this body. Tasks only carry that out.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema

from schemas import tool_schema
from schemas.bodies import is_error_body
from schemas.fleet import ToolDefaults
from schemas.limits import Limits
from schemas.spec_types import INVALID_CALL_NAME, TASK_STATUS, Flags, SessionSpec, ToolSpec
from worker.codecs.openai_chat import decode_arguments, tool_calls_of, tool_message_content
from worker.codecs.protocol import ToolChoice
from worker.errors import (
    RepeatedCallError,
    ToolCallLimitError,
    ToolNotFoundError,
    ToolNotRunError,
    ToolPermissionError,
    ToolValidationError,
    UnknownToolError,
)
from worker.session.outcomes import ToolOutcome
from worker.session.permissions import permission_problem


@dataclass(frozen=True)
class Round:
    """One model call: its reply (a canonical chat.completion, or an error body) and the
    outcomes stored so far for its tool calls, by call index."""

    reply: dict[str, Any]
    outcomes: dict[int, ToolOutcome] = field(default_factory=dict)


@dataclass(frozen=True)
class Session:
    spec: SessionSpec
    backend: str
    rounds: tuple[Round, ...] = ()
    fleet: ToolDefaults = field(default_factory=ToolDefaults)  # the configuration's defaults

    @property
    def auto_tool_call(self) -> bool:
        """Whether the loop runs the tools a reply calls: the spec's flag and the fleet's."""
        return self.spec.flags.auto_tool_call and self.fleet.auto_tool_call

    @property
    def limits(self) -> Limits:
        return self.spec.limits

    @property
    def flags(self) -> Flags:
        return self.spec.flags

    def tools_by_name(self) -> dict[str, ToolSpec]:
        return {t.name: t for t in self.spec.tools}


# What happens next -------------------------------------------------------------------------


@dataclass(frozen=True)
class CallModel:
    round_no: int
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    params: dict[str, Any]  # upstream fields, without tool_choice / parallel_tool_calls
    tool_choice: ToolChoice = None  # neutral: auto | none | required | {"name": f}
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class ToolRun:
    """A call to execute on a tools worker."""

    index: int
    call_id: str
    name: str
    tool: ToolSpec
    arguments: str  # canonical JSON, validated against the tool's parameters


@dataclass(frozen=True)
class RunTools:
    round_no: int
    call_count: int
    runs: tuple[ToolRun, ...]
    # Calls answered without running anything (unknown tool, invalid arguments), by index.
    presets: dict[int, ToolOutcome]


@dataclass(frozen=True)
class Finish:
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not is_error_body(self.body)


Step = CallModel | RunTools | Finish


def next_call(session: Session) -> CallModel:
    """The model call of the next round (the round step's request). The round was published
    only once the previous one was complete, so the plan need not run again to build it."""
    return _call_model(session, len(session.rounds))


def tool_run(spec: SessionSpec, reply: dict[str, Any], index: int) -> ToolRun | None:
    """The run of call `index` of a round, as `plan` builds it and the tool step runs it; None
    when the call names no tool of the spec (plan answers such a call without a run)."""
    calls = tool_calls_of(reply)
    if index >= len(calls):
        return None
    call = calls[index]
    tool = spec.tool(call["function"]["name"])
    if tool is None:
        return None
    return ToolRun(
        index=index,
        call_id=call["id"],
        name=tool.name,
        tool=tool,
        arguments=canonical_arguments(call["function"]["arguments"]),
    )


def plan(session: Session) -> Step:
    """Decide the next step from the stored state alone (so a redelivered step decides alike)."""
    if not session.rounds:
        return _call_model(session, 0)
    round_no = len(session.rounds) - 1
    last = session.rounds[-1]
    if is_error_body(last.reply):
        return Finish(last.reply)
    ended_by = _final_answer_of(session, round_no)
    if ended_by is not None:  # the answer after a limit ended the loop, whatever it says
        return Finish(limited_body(session, last.reply, ended_by))
    calls = tool_calls_of(last.reply)
    if not calls or not session.auto_tool_call:
        return Finish(success_body(session, last.reply))
    presets = _presets(session, last.reply, calls)
    limit = _limit_hit(session, len(calls) - len(presets))
    if limit and not session.flags.final_answer_on_limit:
        return Finish(ToolCallLimitError(f"exceeded {limit}").body())
    if limit:  # answer every call as not run, then ask once more with tool choice none
        presets = {i: _skipped(limit) for i in range(len(calls))}
    if session.flags.strict_unknown_tool:
        unknown = [c for c in calls if c["function"]["name"] not in session.tools_by_name()]
        if unknown:
            return Finish(
                UnknownToolError(f"unknown tool: {unknown[0]['function']['name']}").body()
            )
    if all(i in last.outcomes for i in range(len(calls))):
        return _call_model(session, round_no + 1)
    pending = [i for i in range(len(calls)) if i not in last.outcomes and i not in presets]
    runs = tuple(run for i in pending if (run := tool_run(session.spec, last.reply, i)) is not None)
    unstored = {i: o for i, o in presets.items() if i not in last.outcomes}
    return RunTools(round_no=round_no, call_count=len(calls), runs=runs, presets=unstored)


def _call_model(session: Session, round_no: int) -> CallModel:
    params = dict(session.spec.params)
    choice = neutral_tool_choice(params.pop("tool_choice", None))
    parallel = params.pop("parallel_tool_calls", None)
    if choice not in (None, "auto", "none") and any(tool_calls_of(r.reply) for r in session.rounds):
        # a forced choice holds for the first tool round only, or the model could never answer
        choice = "auto"
    if round_no > 0 and _final_answer_of(session, round_no) is not None:
        choice = "none"  # the last call after a limit: an answer, not more tool calls
    return CallModel(
        round_no=round_no,
        model=session.spec.model,
        messages=transcript(session),
        tools=[{"type": "function", "function": t.function.to_json()} for t in session.spec.tools],
        params=params,
        tool_choice=choice,
        parallel_tool_calls=parallel if isinstance(parallel, bool) else None,
    )


def neutral_tool_choice(raw: Any) -> ToolChoice:
    """auto | none | required | {"name": f}, from the neutral or the OpenAI spelling."""
    if raw == "auto" or raw == "none" or raw == "required":
        return raw  # type: ignore[no-any-return]
    if raw == "any":
        return "required"
    if isinstance(raw, dict):
        name = raw.get("name") or (raw.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return {"name": name}
    return None


def _limit_hit(session: Session, would_run: int) -> str | None:
    """The limit the last round's calls would break: too many rounds, or more executed tool
    calls than max_total_tool_calls (calls answered without running do not count)."""
    limits = session.limits
    if len(session.rounds) >= limits.max_iterations:
        return "max_iterations"
    executed = sum(1 for r in session.rounds[:-1] for o in r.outcomes.values() if o.ran)
    if executed + would_run > limits.max_total_tool_calls:
        return "max_total_tool_calls"
    return None


def _round_limit(session: Session, round_no: int) -> str | None:
    """The limit round `round_no`'s tool calls hit, if they hit one."""
    upto = replace(session, rounds=session.rounds[: round_no + 1])
    reply = upto.rounds[-1].reply
    calls = tool_calls_of(reply) if not is_error_body(reply) else []
    if not calls or not session.auto_tool_call or _limit_hit(upto, len(calls)) is None:
        return None  # the common case, decided without validating the calls again
    return _limit_hit(upto, len(calls) - len(_presets(upto, reply, calls)))


def _final_answer_of(session: Session, round_no: int) -> str | None:
    """The limit that made round `round_no` the final answer (a call with tool choice none)."""
    if round_no == 0 or not session.flags.final_answer_on_limit:
        return None
    return _round_limit(session, round_no - 1)


def _skipped(limit: str) -> ToolOutcome:
    return ToolOutcome.error(ToolNotRunError(f"skipped: exceeded {limit}"))


def _presets(
    session: Session, reply: dict[str, Any], calls: list[dict[str, Any]]
) -> dict[int, ToolOutcome]:
    tools = session.tools_by_name()
    truncated = _finish_reason(reply) == "length"
    presets: dict[int, ToolOutcome] = {}
    for i, call in enumerate(calls):
        name = call["function"]["name"]
        if name == INVALID_CALL_NAME:
            presets[i] = ToolOutcome.error(
                ToolValidationError("this tool call could not be read: it names no function")
            )
        elif name not in tools:
            presets[i] = ToolOutcome.error(ToolNotFoundError(f"unknown tool: {name}"))
        elif problem := permission_problem(tools[name], session.spec.permissions, session.fleet):
            presets[i] = ToolOutcome.error(ToolPermissionError(f"permission denied: {problem}"))
        elif truncated:
            # conformance B1 #13: never execute a call cut off by the token limit
            presets[i] = ToolOutcome.error(
                ToolValidationError("arguments truncated (finish_reason length), not executed")
            )
        elif name != TASK_STATUS and _repeats(session, call) >= REPEAT_LIMIT - 1:
            # conformance B7 68: the model keeps asking the same thing; tell it, do not rerun
            # (asking a task how it is going again is polling, not repeating)
            presets[i] = ToolOutcome.error(
                RepeatedCallError(
                    f"this exact call was made {REPEAT_LIMIT} times in a row; "
                    "use its earlier result or change the arguments"
                )
            )
        else:
            problem = argument_problem(
                call["function"]["arguments"], tools[name].function.parameters
            )
            if problem:
                presets[i] = ToolOutcome.error(ToolValidationError(problem))
    return presets


REPEAT_LIMIT = 3  # the same name and arguments in this many consecutive rounds


def _repeats(session: Session, call: dict[str, Any]) -> int:
    """In how many rounds right before the last one the same call was made."""
    key = _call_key(call)
    count = 0
    for rnd in reversed(session.rounds[:-1]):
        if is_error_body(rnd.reply) or key not in {_call_key(c) for c in tool_calls_of(rnd.reply)}:
            break
        count += 1
    return count


def _call_key(call: dict[str, Any]) -> tuple[str, str]:
    arguments = call["function"]["arguments"]
    with contextlib.suppress(ToolValidationError):
        arguments = canonical_arguments(arguments)
    return call["function"]["name"], arguments


def canonical_arguments(arguments: str) -> str:
    """The arguments a tool receives: the decoded object (repaired, unwrapped) as compact JSON,
    so a tool never sees text other than what was validated."""
    return json.dumps(decode_arguments(arguments), separators=(",", ":"), ensure_ascii=False)


def argument_problem(arguments: str, parameters: dict[str, Any] | None) -> str | None:
    """Why these arguments cannot be passed to the tool, or None when they can."""
    try:
        decoded = decode_arguments(arguments)
    except ToolValidationError as exc:
        return exc.message
    schema = parameters or {"type": "object"}
    try:
        error = jsonschema.exceptions.best_match(tool_schema.validator(schema).iter_errors(decoded))
    except Exception as exc:  # a schema that passed the submit check but still cannot validate
        return f"the tool's parameters schema cannot be checked: {type(exc).__name__}"[:500]
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "arguments"
    return f"{where}: {error.message}"[:500]


def _finish_reason(reply: dict[str, Any]) -> str | None:
    choices = reply.get("choices") or [{}]
    reason = choices[0].get("finish_reason")
    return reason if isinstance(reason, str) else None


# Transcript, bodies, metrics ---------------------------------------------------------------


REPLAYED_FIELDS = ("tool_calls", "reasoning_content", "reasoning", "_provider")


def assistant_message(reply: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn as history: with its thinking and the provider's own blocks, which
    a codec replays verbatim (Anthropic signed thinking, Gemini thought signatures)."""
    message = dict((reply.get("choices") or [{}])[0].get("message") or {})
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    out.update({k: message[k] for k in REPLAYED_FIELDS if message.get(k)})
    return out


def transcript(session: Session, missing: ToolOutcome | None = None) -> list[dict[str, Any]]:
    """Spec messages, then per round the assistant message and one tool message per call, in
    call order. A call with no stored outcome gets `missing` (or the plan's verdict), so the
    transcript never holds a tool call without its answer."""
    messages: list[dict[str, Any]] = [dict(m) for m in session.spec.messages]
    auto = session.auto_tool_call
    envelope = session.flags.tool_result_envelope
    for round_no, rnd in enumerate(session.rounds):
        if is_error_body(rnd.reply):
            break
        messages.append(assistant_message(rnd.reply))
        calls = tool_calls_of(rnd.reply)
        if not calls or not auto:
            continue
        answered = all(i in rnd.outcomes for i in range(len(calls)))
        # a round whose calls are all answered needs no fill (and no schema validation)
        fill = {} if answered else _fill_for_round(session, round_no, calls, missing)
        for i, call in enumerate(calls):
            outcome = rnd.outcomes.get(i) or fill.get(i)
            if outcome is None:
                continue
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": tool_message_content(
                        outcome.message(envelope, session.limits.compress_over_bytes, call["id"])
                    ),
                }
            )
    return messages


def _fill_for_round(
    session: Session, round_no: int, calls: list[dict[str, Any]], missing: ToolOutcome | None
) -> dict[int, ToolOutcome]:
    if round_no != len(session.rounds) - 1:
        return {}
    upto = replace(session, rounds=session.rounds[: round_no + 1])
    fill = _presets(upto, session.rounds[round_no].reply, calls)
    limit = _limit_hit(upto, len(calls) - len(fill))
    if limit:
        return {i: _skipped(limit) for i in range(len(calls))}
    if session.flags.strict_unknown_tool and any(
        o.code == ToolNotFoundError.code for o in fill.values()
    ):
        for i in range(len(calls)):
            fill.setdefault(
                i,
                ToolOutcome.error(ToolNotRunError("skipped: the session ended on an unknown tool")),
            )
    if missing is not None:
        for i in range(len(calls)):
            fill.setdefault(i, missing)
    return fill


def success_body(session: Session, reply: dict[str, Any]) -> dict[str, Any]:
    """The reply in OpenAI shape: the provider's replay blocks stay in the transcript only."""
    body = dict(reply)
    choices = [dict(c) for c in body.get("choices") or []]
    for choice in choices:
        if isinstance(choice.get("message"), dict) and "_provider" in choice["message"]:
            choice["message"] = {k: v for k, v in choice["message"].items() if k != "_provider"}
    if choices:
        body["choices"] = choices
    body["_spear"] = {
        "backend": session.backend,
        "model": reply.get("model") or session.spec.model,
    }
    return body


def limited_body(session: Session, reply: dict[str, Any], limit: str) -> dict[str, Any]:
    """The final answer after a limit ended the loop: the reply, without tool calls the
    model still made, saying which limit ended it (`_spear.limit`)."""
    body = success_body(session, reply)
    for choice in body.get("choices") or []:
        message = choice.get("message")
        if isinstance(message, dict) and "tool_calls" in message:
            choice["message"] = {k: v for k, v in message.items() if k != "tool_calls"}
    body["_spear"]["limit"] = ToolCallLimitError(f"exceeded {limit}").body()["error"]
    return body


CANCELLED = ToolOutcome.error(ToolNotRunError("session cancelled before this call ran"))
