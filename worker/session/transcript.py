"""A session's transcript and the bodies it ends with, from its stored rounds. Pure, like the
engine: the transcript is the next model call's messages and the result record's history."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.codecs.openai_chat import tool_message_content
from worker.codecs.reply import Reply
from worker.errors import ToolCallLimitError
from worker.session.outcomes import ToolOutcome
from worker.session.state import Session

# what an assistant turn keeps as history: its calls, its thinking and the provider's own
# blocks, which a codec replays verbatim (Anthropic signed thinking, Gemini thought signatures)
REPLAYED_FIELDS = ("tool_calls", "reasoning_content", "reasoning", "_provider")


def assistant_message(reply: Reply) -> dict[str, Any]:
    """The assistant turn of a reply, as history."""
    message = reply.message
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    out.update({k: message[k] for k in REPLAYED_FIELDS if message.get(k)})
    return out


def transcript(
    session: Session, fill: Mapping[int, ToolOutcome] | None = None
) -> list[dict[str, Any]]:
    """Spec messages, then per round the assistant message and one tool message per call, in
    call order. A call of the last round with no stored outcome gets its entry of `fill` (the
    ending's answer to it), so an ended session's transcript never holds an unanswered call."""
    messages: list[dict[str, Any]] = [dict(m) for m in session.spec.messages]
    auto = session.auto_tool_call
    envelope = session.flags.tool_result_envelope
    excerpt_over = session.limits.compress_over_bytes
    last = len(session.rounds) - 1
    for round_no, rnd in enumerate(session.rounds):
        reply = rnd.reply
        if reply.is_error:
            break
        messages.append(assistant_message(reply))
        if not reply.calls or not auto:
            continue
        for i, call in enumerate(reply.calls):
            outcome = rnd.outcomes.get(i)
            if outcome is None and fill is not None and round_no == last:
                outcome = fill.get(i)
            if outcome is None:
                continue
            content = tool_message_content(outcome.message(envelope, excerpt_over, call.id))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return messages


def success_body(session: Session, reply: Reply) -> dict[str, Any]:
    """The reply in OpenAI shape: the provider's replay blocks stay in the transcript only."""
    body = dict(reply.completion)
    choices = [dict(c) for c in body.get("choices") or []]
    for choice in choices:
        if isinstance(choice.get("message"), dict) and "_provider" in choice["message"]:
            choice["message"] = {k: v for k, v in choice["message"].items() if k != "_provider"}
    if choices:
        body["choices"] = choices
    body["_spear"] = {
        "backend": session.backend,
        "model": reply.completion.get("model") or session.spec.model,
    }
    return body


def limited_body(session: Session, reply: Reply, limit: str) -> dict[str, Any]:
    """The final answer after a limit ended the loop: the reply, without tool calls the
    model still made, saying which limit ended it (`_spear.limit`)."""
    body = success_body(session, reply)
    for choice in body.get("choices") or []:
        message = choice.get("message")
        if isinstance(message, dict) and "tool_calls" in message:
            choice["message"] = {k: v for k, v in message.items() if k != "tool_calls"}
    body["_spear"]["limit"] = ToolCallLimitError(f"exceeded {limit}").body()["error"]
    return body
