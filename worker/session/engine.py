"""The pure session engine: the auto tool-call loop of docs/guest-abi.md section 4.

No Celery, Redis, HTTP or wasmtime here. Given what a session has stored so far (its spec
and, per round, the model reply and the tool outcomes), `plan` says what happens next: call
the model, run these tools, or finish with this body. The plan carries its own values (the
runs with their decoded arguments, the calls answered without running, the finish body) to
whoever carries it out, so nothing downstream plans again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema

from schemas import tool_schema
from schemas.bodies import is_error_body
from schemas.spec_types import INVALID_CALL_NAME, TASK_STATUS, SessionSpec, ToolSpec
from worker.codecs.openai_chat import decode_arguments
from worker.codecs.protocol import ToolChoice
from worker.codecs.reply import Arguments, Reply, ReplyCall
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
from worker.session.state import Session
from worker.session.transcript import limited_body, success_body, transcript

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
    # the tool messages the last round's unanswered calls get in the session's transcript
    fill: dict[int, ToolOutcome] = field(default_factory=dict, compare=False)

    @property
    def ok(self) -> bool:
        return not is_error_body(self.body)


Step = CallModel | RunTools | Finish


def next_call(session: Session) -> CallModel:
    """The model call of the next round (the round step's request). The round was published
    only once the previous one was complete, so the plan need not run again to build it."""
    return _call_model(session, len(session.rounds))


def tool_run(spec: SessionSpec, reply: Reply, index: int) -> ToolRun | None:
    """The run of call `index` of a round, as `plan` builds it; None when the call names no
    tool of the spec or its arguments cannot be read (plan answers such a call without a
    run)."""
    if index >= len(reply.calls):
        return None
    return _run(spec, index, reply.calls[index])


def _run(spec: SessionSpec, index: int, call: ReplyCall) -> ToolRun | None:
    tool = spec.tool(call.name)
    canonical = call.arguments.canonical
    if tool is None or canonical is None:
        return None
    return ToolRun(index, call.id, tool.name, tool, canonical)


def plan(session: Session) -> Step:
    """Decide the next step from the stored state alone (so a redelivered step decides alike)."""
    if not session.rounds:
        return _call_model(session, 0)
    round_no = len(session.rounds) - 1
    last = session.rounds[-1]
    reply = last.reply
    if reply.is_error:
        return Finish(reply.completion)
    calls = reply.calls
    answered = all(i in last.outcomes for i in range(len(calls)))
    ended_by = _final_answer_of(session, round_no)
    if ended_by is not None:  # the answer after a limit ended the loop, whatever it says
        fill = {}
        if calls and session.auto_tool_call and not answered:
            fill = _closing_fill(session, _presets(session, reply))
        return Finish(limited_body(session, reply, ended_by), fill)
    if not calls or not session.auto_tool_call:
        return Finish(success_body(session, reply))
    presets = _presets(session, reply)
    limit = _limit_hit(session, len(calls) - len(presets))
    if limit and not session.flags.final_answer_on_limit:
        return Finish(ToolCallLimitError(f"exceeded {limit}").body(), _skip_all(calls, limit))
    if limit:  # answer every call as not run, then ask once more with tool choice none
        presets = _skip_all(calls, limit)
    if session.flags.strict_unknown_tool:
        unknown = [c for c in calls if c.name not in session.tools_by_name()]
        if unknown:
            body = UnknownToolError(f"unknown tool: {unknown[0].name}").body()
            return Finish(body, _closing_fill(session, presets))
    if answered:
        return _call_model(session, round_no + 1)
    pending = [i for i in range(len(calls)) if i not in last.outcomes and i not in presets]
    runs = tuple(run for i in pending if (run := _run(session.spec, i, calls[i])) is not None)
    unstored = {i: o for i, o in presets.items() if i not in last.outcomes}
    return RunTools(round_no=round_no, call_count=len(calls), runs=runs, presets=unstored)


def _call_model(session: Session, round_no: int) -> CallModel:
    params = dict(session.spec.params)
    choice = neutral_tool_choice(params.pop("tool_choice", None))
    parallel = params.pop("parallel_tool_calls", None)
    if choice not in (None, "auto", "none") and any(r.reply.calls for r in session.rounds):
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
    calls = reply.calls
    if not calls or not session.auto_tool_call or _limit_hit(upto, len(calls)) is None:
        return None  # the common case, decided without validating the calls again
    return _limit_hit(upto, len(calls) - len(_presets(upto, reply)))


def _final_answer_of(session: Session, round_no: int) -> str | None:
    """The limit that made round `round_no` the final answer (a call with tool choice none)."""
    if round_no == 0 or not session.flags.final_answer_on_limit:
        return None
    return _round_limit(session, round_no - 1)


def _skip_all(calls: tuple[ReplyCall, ...], limit: str) -> dict[int, ToolOutcome]:
    skipped = ToolOutcome.error(ToolNotRunError(f"skipped: exceeded {limit}"))
    return dict.fromkeys(range(len(calls)), skipped)


def _closing_fill(session: Session, presets: dict[int, ToolOutcome]) -> dict[int, ToolOutcome]:
    """What the last round's calls are answered with in the transcript when the session ends
    on them: the calls answered without running, every call skipped when a limit ends the
    loop, and the rest skipped when an unknown tool ends it."""
    calls = session.rounds[-1].reply.calls
    limit = _limit_hit(session, len(calls) - len(presets))
    if limit:
        return _skip_all(calls, limit)
    fill = dict(presets)
    if session.flags.strict_unknown_tool and any(
        o.code == ToolNotFoundError.code for o in fill.values()
    ):
        skipped = ToolOutcome.error(
            ToolNotRunError("skipped: the session ended on an unknown tool")
        )
        for i in range(len(calls)):
            fill.setdefault(i, skipped)
    return fill


def _presets(session: Session, reply: Reply) -> dict[int, ToolOutcome]:
    """The calls of `reply` (the last round's) answered without running, by index."""
    tools = session.tools_by_name()
    truncated = reply.finish_reason == "length"
    presets: dict[int, ToolOutcome] = {}
    for i, call in enumerate(reply.calls):
        name = call.name
        if name == INVALID_CALL_NAME:
            presets[i] = ToolOutcome.error(
                ToolValidationError("this tool call could not be read: it names no function")
            )
        elif name not in tools:
            presets[i] = ToolOutcome.error(ToolNotFoundError(f"unknown tool: {name}"))
        elif problem := permission_problem(tools[name], session.spec.permissions, session.fleet):
            presets[i] = ToolOutcome.error(ToolPermissionError(f"permission denied: {problem}"))
        elif truncated:
            # a call cut off by the token limit is never executed (its arguments are partial)
            presets[i] = ToolOutcome.error(
                ToolValidationError("arguments truncated (finish_reason length), not executed")
            )
        elif name != TASK_STATUS and _repeats(session, call) >= REPEAT_LIMIT - 1:
            # the model keeps asking the same thing: tell it, do not run it again (asking a
            # task how it is going again is polling, not repeating)
            presets[i] = ToolOutcome.error(
                RepeatedCallError(
                    f"this exact call was made {REPEAT_LIMIT} times in a row; "
                    "use its earlier result or change the arguments"
                )
            )
        elif problem := decoded_problem(call.arguments, tools[name].function.parameters):
            presets[i] = ToolOutcome.error(ToolValidationError(problem))
    return presets


REPEAT_LIMIT = 3  # the same name and arguments in this many consecutive rounds


def _repeats(session: Session, call: ReplyCall) -> int:
    """In how many rounds right before the last one the same call was made."""
    key = call.key
    count = 0
    for rnd in reversed(session.rounds[:-1]):
        if rnd.reply.is_error or key not in {c.key for c in rnd.reply.calls}:
            break
        count += 1
    return count


def argument_problem(arguments: str, parameters: dict[str, Any] | None) -> str | None:
    """Why these arguments (as text) cannot be passed to the tool, or None when they can."""
    try:
        decoded = decode_arguments(arguments)
    except ToolValidationError as exc:
        return exc.message
    return _schema_problem(decoded, parameters)


def decoded_problem(arguments: Arguments, parameters: dict[str, Any] | None) -> str | None:
    """Why decoded arguments cannot be passed to the tool, or None when they can."""
    if arguments.value is None:
        return arguments.problem
    return _schema_problem(arguments.value, parameters)


def _schema_problem(decoded: dict[str, Any], parameters: dict[str, Any] | None) -> str | None:
    schema = parameters or {"type": "object"}
    try:
        error = jsonschema.exceptions.best_match(tool_schema.validator(schema).iter_errors(decoded))
    except tool_schema.SchemaTooDeep as exc:  # its $refs loop, or recurse with deep arguments
        return f"the tool's parameters schema cannot be checked: {exc}"[:500]
    except Exception as exc:  # a schema that passed the submit check but still cannot validate
        return f"the tool's parameters schema cannot be checked: {type(exc).__name__}"[:500]
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "arguments"
    return f"{where}: {error.message}"[:500]


CANCELLED = ToolOutcome.error(ToolNotRunError("session cancelled before this call ran"))
