"""The wire protocols the workers speak to LLM providers, each declared once: its name (a
backend's `protocol`), how a request carries the API key, the codec that speaks it, where the
replay server serves it, what of an earlier assistant turn goes back to it, and the hosted API
a built-in backend of the same name points at.

The configuration's validation and `cchatq config check` read these declarations, the workers
build their codec table from them, and the local fleet makes its replay backends from them. A
new provider is its codec module in `worker/codecs/` plus one entry in `PROTOCOLS` below.

The codec is named by its import path, not imported: the producer reads this module and never
imports the worker (`worker.codecs.registry` resolves the path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class KeyHeader:
    """How a request carries the API key: `name: <scheme> <key>`, or the bare key when the
    protocol has no scheme."""

    name: str
    scheme: str = ""

    def value(self, key: str) -> str:
        return f"{self.scheme} {key}" if self.scheme else key


@dataclass(frozen=True)
class ReplayRules:
    """What of an earlier assistant turn the codec sends back to this protocol.

    A decoded turn may keep its wire copy in `_provider[<protocol name>][own_entry]`; the codec
    sends that copy back verbatim (signatures must return untouched) and ignores the other
    protocols' entries."""

    # the key of the turn's own wire copy ("content", "parts"); None: the turn keeps none
    own_entry: str | None = None
    # the turn's reasoning fields (of CHAT_REASONING_FIELDS) sent back as they are, and only
    # when the request's params ask (`replay_reasoning`): DeepSeek's thinking mode needs its
    # `reasoning_content` back, strict servers reject unknown fields
    reasoning_fields: tuple[str, ...] = ()
    # thinking goes back only as signed blocks inside the own entry (bare reasoning text is
    # dropped), so the replay fleet also runs this protocol with thinking on
    signed_thinking: bool = False


@dataclass(frozen=True)
class HostedApi:
    """The real API behind the built-in backend named like the protocol."""

    base_url: str
    api_key_env: str  # the variable its SDK reads


@dataclass(frozen=True)
class WireProtocol:
    name: str
    codec: str  # "module:Class" of the codec, a no-argument factory
    key_header: KeyHeader
    replay_path: str  # the replay server's path prefix for this protocol ("/v1")
    replay_model: str  # the replay server's model for a scenario: "replay/{scenario}"
    replay: ReplayRules
    # the provider its calls are traced as (OpenTelemetry's gen_ai.provider.name)
    genai_provider: str
    hosted: HostedApi | None = None  # None: no built-in backend of this name

    def replay_model_for(self, scenario: str) -> str:
        return self.replay_model.format(scenario=scenario)


BEARER = KeyHeader("Authorization", "Bearer")
# DeepSeek and older vLLM send `reasoning_content`; vLLM after its rename and OpenRouter
# send `reasoning`
CHAT_REASONING_FIELDS = ("reasoning_content", "reasoning")

OPENAI = WireProtocol(
    name="openai",
    codec="worker.codecs.openai_codec:OpenAICodec",
    key_header=BEARER,
    replay_path="/v1",
    replay_model="replay/{scenario}",
    replay=ReplayRules(reasoning_fields=CHAT_REASONING_FIELDS),
    genai_provider="openai",
    hosted=HostedApi("https://api.openai.com/v1", "OPENAI_API_KEY"),
)
ANTHROPIC = WireProtocol(
    name="anthropic",
    codec="worker.codecs.anthropic:AnthropicCodec",
    key_header=KeyHeader("x-api-key"),
    replay_path="/v1",
    replay_model="replay/{scenario}",
    # the turn's content blocks, whose thinking blocks carry their signatures
    replay=ReplayRules(own_entry="content", signed_thinking=True),
    genai_provider="anthropic",
    hosted=HostedApi("https://api.anthropic.com/v1", "ANTHROPIC_API_KEY"),
)
GEMINI = WireProtocol(
    name="gemini",
    codec="worker.codecs.gemini:GeminiCodec",
    key_header=KeyHeader("x-goog-api-key"),
    replay_path="/v1beta",
    replay_model="replay-{scenario}",
    # the model content's parts, with their thoughtSignature
    replay=ReplayRules(own_entry="parts", signed_thinking=True),
    genai_provider="gcp.gemini",
    hosted=HostedApi("https://generativelanguage.googleapis.com/v1beta", "GEMINI_API_KEY"),
)
TEXT_TAGS = WireProtocol(
    name="openai-text-tags",
    codec="worker.codecs.text_tags:TextTagCodec",
    key_header=BEARER,
    replay_path="/v1",
    replay_model="replay-tags/{scenario}",
    # the turn's text as the model wrote it, tags included; the chat-completions body it
    # travels in replays reasoning as the openai protocol does
    replay=ReplayRules(own_entry="content", reasoning_fields=CHAT_REASONING_FIELDS),
    # chat completions with tools as tags in the text: an OpenAI-compatible endpoint's
    genai_provider="openai",
)

PROTOCOLS: Mapping[str, WireProtocol] = MappingProxyType(
    {p.name: p for p in (OPENAI, ANTHROPIC, GEMINI, TEXT_TAGS)}
)
NAMES: tuple[str, ...] = tuple(PROTOCOLS)


def declared(name: str) -> WireProtocol:
    """The protocol of that name (KeyError naming the known ones otherwise)."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise KeyError(f"unknown protocol {name!r}; known: {', '.join(NAMES)}") from None
