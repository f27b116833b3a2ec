"""Google Gemini generateContent codec (REST v1beta, camelCase JSON): canonical OpenAI
`chat.completion` <-> Gemini, for JSON replies and `streamGenerateContent?alt=sse` streams.
Requests are built here; replies are decoded in `gemini_reply` (JSON, errors) and
`gemini_stream` (SSE). Pure: no I/O.

Decisions where the wire format leaves a choice:
  - Call ids: a `functionCall.id` from Gemini is the canonical id and is echoed on
    `functionCall.id`/`functionResponse.id`. Without one we synthesise `gcall_<24 hex>` from
    (responseId, or model + request length when there is none, candidate index, part index,
    name): stable for a redelivered step, distinct for two calls to one tool. Ids starting with
    `gcall_` are ours and never go on the wire.
  - Replay: an assistant turn carrying `_provider.gemini.parts` is sent as those parts,
    verbatim (a thoughtSignature must come back on its own part, or Gemini answers 400);
    decode keeps them whenever a part has a `thoughtSignature`, there are function calls, or
    a part has no canonical form (code execution, inline data...). Other assistant turns are
    rebuilt as text + functionCall parts; their `reasoning_content` is not sent (an unsigned
    thought is useless to Gemini).
  - Consecutive contents with the same role are merged, so roles alternate and all responses
    of one turn share one `user` content. Every system/developer message, wherever it sits,
    becomes a part of `systemInstruction` (Gemini has no mid-conversation system turn).
  - Tool results (`functionResponse.response` must be an object): a JSON object is sent as
    that object (our error JSON stays `{"error": {...}}`); anything else as
    `{"content": <text>}`.
  - Replayed calls (`functionCall.args` must be an object, in kept parts too): arguments that
    are no object replay as `replay_arguments` says (`{"_raw_arguments": <text>}`).
  - Finish reasons: STOP/OTHER/unknown -> stop (tool_calls when calls are present: Gemini
    says STOP even then); MAX_TOKENS/CONTINUATION -> length (a call cut off by the token
    limit never runs); SAFETY, RECITATION, BLOCKLIST, PROHIBITED_CONTENT, SPII, LANGUAGE,
    IMAGE_*, MODEL_ARMOR -> content_filter. MALFORMED_FUNCTION_CALL, UNEXPECTED_TOOL_CALL and
    MALFORMED_RESPONSE raise ProviderRetryableError: nothing ran, so the round is retried
    under the backend's retry budget. MISSING_THOUGHT_SIGNATURE raises ProviderRequestError
    (our request lacked a signature; a retry would fail alike).
  - No candidates: `promptFeedback.blockReason` -> ProviderRequestError naming the reason (a
    retry is blocked alike); none at all -> ProviderProtocolError.
  - Usage: prompt = promptTokenCount + toolUsePromptTokenCount; completion =
    candidatesTokenCount + thoughtsTokenCount, unless prompt + candidates already equals
    totalTokenCount (then candidates include the thoughts); total = totalTokenCount.
    `prompt_tokens_details.cached_tokens`, `completion_tokens_details.reasoning_tokens` and the
    raw `usageMetadata` as `gemini_details`.
  - Params (`generationConfig`): temperature, top_p, top_k, max_tokens/max_completion_tokens,
    stop, presence_penalty, frequency_penalty, seed, logprobs, top_logprobs, response_format
    (json_object/json_schema) are translated; any Gemini generationConfig field name (camelCase
    or snake_case, see _GENERATION_CONFIG) passes through and wins over its OpenAI alias;
    `safetySettings` and `cachedContent` go to the top level of the body. Everything else is
    dropped (debug log): n (we read one candidate), user, logit_bias, service_tier, store,
    metadata, reasoning_effort, parallel_tool_calls (Gemini has no switch)... A set
    `ChatRequest.max_tokens` wins over params; thinking on sets `thinkingConfig` whole.
  - tool_choice without tools is not sent; None leaves Gemini's default (AUTO).
"""

from __future__ import annotations

import copy
import json
import logging
import mimetypes
import re
from typing import Any

from schemas.protocols import GEMINI
from worker.codecs.gemini_reply import (
    PROTOCOL,
    SYNTHETIC_ID_PREFIX,
    decode_completion,
    error_object,
    retry_delay,
)
from worker.codecs.gemini_schema import gemini_parameters
from worker.codecs.gemini_stream import GeminiStreamAssembler
from worker.codecs.openai_chat import content_text, tool_result_text
from worker.codecs.protocol import ChatRequest, WireRequest, own_replay
from worker.codecs.replay_arguments import arguments_text, replay_object
from worker.errors import ProviderRequestError

__all__ = [
    "PROTOCOL",
    "RESULT_KEY",
    "SYNTHETIC_ID_PREFIX",
    "GeminiCodec",
    "GeminiStreamAssembler",
]

log = logging.getLogger(__name__)

RESULT_KEY = "content"  # a non-object tool result goes back as {"content": text}

_OPENAI_PARAMS = {
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "max_tokens": "maxOutputTokens",
    "max_completion_tokens": "maxOutputTokens",
    "stop": "stopSequences",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
    "seed": "seed",
    "logprobs": "responseLogprobs",
    "top_logprobs": "logprobs",
}
_GENERATION_CONFIG = frozenset(
    {
        "stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema",
        "responseModalities", "candidateCount", "maxOutputTokens", "temperature", "topP", "topK",
        "seed", "presencePenalty", "frequencyPenalty", "responseLogprobs", "logprobs",
        "enableEnhancedCivicAnswers", "speechConfig", "thinkingConfig", "imageConfig",
        "mediaResolution",
    }
)  # fmt: skip
_TOP_LEVEL = frozenset({"safetySettings", "cachedContent"})
_CHOICE_MODES = {"auto": "AUTO", "none": "NONE", "required": "ANY"}
_DATA_URL = re.compile(r"^data:([^;,]+)?(?:;[^,]*)?;base64,(.*)$", re.DOTALL)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


class GeminiCodec:
    protocol = PROTOCOL

    # -----------------------------------------------------------------------------------------
    # Requests

    def encode(self, request: ChatRequest) -> WireRequest:
        system, contents = _contents(request.messages)
        body: dict[str, Any] = {"contents": contents}
        if system:
            body["systemInstruction"] = {"parts": system}
        if request.tools:
            body["tools"] = [{"functionDeclarations": [_declaration(t) for t in request.tools]}]
            config = _calling_config(request.tool_choice)
            if config:
                body["toolConfig"] = {"functionCallingConfig": config}
        generation, top = _generation_config(request)
        if generation:
            body["generationConfig"] = generation
        body.update(top)
        model = request.model.removeprefix("models/")
        if request.stream:
            return WireRequest(
                path=f"/models/{model}:streamGenerateContent", body=body, query={"alt": "sse"}
            )
        return WireRequest(path=f"/models/{model}:generateContent", body=body)

    # -----------------------------------------------------------------------------------------
    # Replies

    def decode(self, body: Any, request: ChatRequest) -> dict[str, Any]:
        return decode_completion(body, request)

    def assembler(self, request: ChatRequest) -> GeminiStreamAssembler:
        return GeminiStreamAssembler(request)

    def retry_after_s(self, status: int, body: Any) -> float | None:
        """The `retryDelay` of a `google.rpc.RetryInfo` in `error.details` ("7s", "1.5s", also
        "750ms" or {"seconds", "nanos"}), used when there is no Retry-After header, on whatever
        status the edge retries."""
        return retry_delay(error_object(body))


# ---------------------------------------------------------------------------------------------
# Request parts


def _contents(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, from every earlier assistant turn
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            text = content_text(message.get("content"))
            if text:
                system.append({"text": text})
        elif role == "user":
            _append(contents, "user", _user_parts(message.get("content")))
        elif role == "assistant":
            _append(contents, "model", _model_parts(message, names))
        elif role == "tool":
            _append(contents, "user", [_function_response(message, names)])
        else:
            raise ProviderRequestError(f"message role {str(role)[:20]!r} has no Gemini form")
    return system, contents


def _append(contents: list[dict[str, Any]], role: str, parts: list[dict[str, Any]]) -> None:
    if not parts:
        return  # Gemini rejects a content without parts
    if contents and contents[-1]["role"] == role:
        contents[-1]["parts"].extend(parts)
    else:
        contents.append({"role": role, "parts": parts})


def _user_parts(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        text = content_text(content)
        return [{"text": text}] if text else []
    return [p for p in (_user_part(item) for item in content) if p]


def _user_part(item: Any) -> dict[str, Any] | None:
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "text":
        text = item.get("text")
        return {"text": text} if isinstance(text, str) and text else None
    if kind == "image_url":
        image = item.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str) and url:
            return _media_part(url)
    if kind == "input_audio" and isinstance(item.get("input_audio"), dict):
        audio = item["input_audio"]
        mime = f"audio/{audio.get('format') or 'wav'}"
        return {"inlineData": {"mimeType": mime, "data": audio.get("data") or ""}}
    if kind == "file" and isinstance(item.get("file"), dict):
        data = item["file"].get("file_data")
        if isinstance(data, str) and data:
            return _media_part(data)
    raise ProviderRequestError(f"user content part {str(kind)[:20]!r} has no Gemini form")


def _media_part(url: str) -> dict[str, Any]:
    match = _DATA_URL.match(url)
    if match:
        mime = match.group(1) or "application/octet-stream"
        return {"inlineData": {"mimeType": mime, "data": match.group(2)}}
    file_data = {"fileUri": url}
    mime, _ = mimetypes.guess_type(url)
    if mime:
        file_data["mimeType"] = mime
    return {"fileData": file_data}


def _model_parts(message: dict[str, Any], names: dict[str, str]) -> list[dict[str, Any]]:
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    for call in calls:
        fn = call.get("function") or {}
        if isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
            names[call["id"]] = fn["name"]
    replay = own_replay(message, GEMINI)
    if isinstance(replay, list):
        return [_replayed_part(p) for p in replay]  # verbatim, signatures untouched
    parts: list[dict[str, Any]] = []
    text = content_text(message.get("content"))
    if text:
        parts.append({"text": text})
    for call in calls:
        fn = call.get("function") or {}
        function_call: dict[str, Any] = {
            "name": fn.get("name"),
            "args": replay_object(fn.get("arguments")),
        }
        if _is_provider_id(call.get("id")):
            function_call["id"] = call["id"]
        parts.append({"functionCall": function_call})
    return parts


def _replayed_part(part: Any) -> Any:
    """A kept part as it came, but `functionCall.args` an object (a protobuf Struct: anything
    else fails the whole request); see `replay_arguments`."""
    out = copy.deepcopy(part)
    call = out.get("functionCall") if isinstance(out, dict) else None
    if isinstance(call, dict) and "args" in call and not isinstance(call["args"], dict):
        call["args"] = replay_object(arguments_text(call["args"]))
    return out


def _is_provider_id(call_id: Any) -> bool:
    """A Gemini-issued id (echoed on the wire), not one we synthesised."""
    return (
        isinstance(call_id, str) and bool(call_id) and not call_id.startswith(SYNTHETIC_ID_PREFIX)
    )


def _function_response(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    name = names.get(call_id) if isinstance(call_id, str) else None
    name = name or message.get("name")
    if not isinstance(name, str) or not name:
        raise ProviderRequestError("a tool message answers no earlier tool call (name unknown)")
    text = tool_result_text(message.get("content"))
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    response: dict[str, Any] = parsed if isinstance(parsed, dict) else {RESULT_KEY: text}
    function_response: dict[str, Any] = {"name": name, "response": response}
    if _is_provider_id(call_id):
        function_response["id"] = call_id
    return {"functionResponse": function_response}


def _declaration(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ProviderRequestError("only function tools with a name have a Gemini form")
    out: dict[str, Any] = {"name": fn["name"]}
    if isinstance(fn.get("description"), str) and fn["description"]:
        out["description"] = fn["description"]
    parameters = gemini_parameters(fn.get("parameters"))
    if parameters is not None:
        out["parameters"] = parameters
    return out


def _calling_config(choice: Any) -> dict[str, Any] | None:
    if isinstance(choice, str) and choice in _CHOICE_MODES:
        return {"mode": _CHOICE_MODES[choice]}
    if isinstance(choice, dict) and isinstance(choice.get("name"), str) and choice["name"]:
        return {"mode": "ANY", "allowedFunctionNames": [choice["name"]]}
    return None


def _generation_config(request: ChatRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    aliased: dict[str, Any] = {}
    native: dict[str, Any] = {}
    top: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in request.params.items():
        camel = _camel(key)
        if key in _OPENAI_PARAMS:
            aliased[_OPENAI_PARAMS[key]] = value
        elif key == "response_format":
            aliased.update(_response_format(value))
        elif camel in _GENERATION_CONFIG:
            native[camel] = value
        elif camel in _TOP_LEVEL:
            top[camel] = value
        else:
            dropped.append(key)
    if dropped:
        log.debug("gemini: params with no Gemini form dropped: %s", ", ".join(sorted(dropped)))
    config = {**aliased, **native}
    if isinstance(config.get("stopSequences"), str):
        config["stopSequences"] = [config["stopSequences"]]
    if request.max_tokens is not None:
        config["maxOutputTokens"] = request.max_tokens
    if request.thinking_budget_tokens is not None:
        config["thinkingConfig"] = {
            "thinkingBudget": request.thinking_budget_tokens,
            "includeThoughts": True,
        }
    return config, top


def _response_format(value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"responseMimeType": "application/json"}
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema")
        out: dict[str, Any] = {"responseMimeType": "application/json"}
        if isinstance(schema, dict):
            out["responseJsonSchema"] = schema  # full JSON Schema: no dialect cleaning
        return out
    return {}
