"""The wire protocols, declared once (schemas/protocols.py): the workers' codec table, the
configuration's check, the API key header, the built-in and replay backends and the replay
rules all read the same declarations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from producer import cli
from producer.fleet import replay_backend_name, replay_backends
from schemas import config, protocols
from schemas.config import ConfigError, parse_config
from schemas.fleet_config import builtin_backends
from schemas.protocols import PROTOCOLS, KeyHeader, WireProtocol, declared
from tests.test_provider_http import REQUEST, Reply, ScriptedServer
from worker.codecs import registry
from worker.codecs.protocol import ChatRequest, kept_for_replay, own_replay
from worker.config import BackendConfig
from worker.edges.provider_http import HttpProvider
from worker.errors import ProviderError

DECLARED = list(PROTOCOLS.values())


def _ids(protocol: WireProtocol) -> str:
    return protocol.name


@pytest.mark.parametrize("protocol", DECLARED, ids=_ids)
def test_every_declared_codec_resolves_and_speaks_its_declared_name(
    protocol: WireProtocol,
) -> None:
    codec = registry.codec_for(protocol.name)
    assert type(codec) is registry.resolve(protocol)
    assert codec.protocol == protocol.name
    for method in ("encode", "decode", "assembler", "retry_after_s"):
        assert callable(getattr(codec, method))


def test_the_configuration_check_and_the_workers_read_the_same_declarations() -> None:
    # `cchatq config check` and submit validate backends with this field, the workers build
    # their codec table from this mapping: one object, so neither can list another protocol
    choices = config._BackendSchema().fields["protocol"].validators[0].choices  # type: ignore[attr-defined]
    assert choices is protocols.NAMES
    assert registry.PROTOCOLS is protocols.PROTOCOLS
    assert tuple(registry.CODECS) == protocols.NAMES == tuple(PROTOCOLS)


def test_the_demo_speaks_each_declared_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    for name in protocols.NAMES:
        assert parser.parse_args(["demo", "--provider", name]).provider == name
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--provider", "grpc"])
    assert "invalid choice: 'grpc'" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", DECLARED, ids=_ids)
def test_a_backend_may_name_each_declared_protocol_and_no_other(protocol: WireProtocol) -> None:
    backend = {"base_url": "http://h/v1", "protocol": protocol.name}
    assert parse_config({"backends": {"b": backend}}).backends["b"].protocol == protocol.name
    with pytest.raises(ConfigError, match="Must be one of: " + ", ".join(protocols.NAMES)):
        parse_config({"backends": {"b": {**backend, "protocol": protocol.name + "-x"}}})


def test_unknown_protocol_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: openai, anthropic, gemini, openai-text-tags"):
        registry.codec_for("grpc")


def test_built_in_backends_are_the_hosted_apis_declared() -> None:
    backends = builtin_backends()
    hosted = [p for p in DECLARED if p.hosted is not None]
    assert [p.name for p in hosted] == ["openai", "anthropic", "gemini"]
    assert list(backends) == [*(p.name for p in hosted), "replay"]
    for protocol in hosted:
        assert protocol.hosted is not None
        backend = backends[protocol.name]
        assert (backend.protocol, backend.base_url, backend.api_key_env) == (
            protocol.name,
            protocol.hosted.base_url,
            protocol.hosted.api_key_env,
        )


def test_replay_backends_sit_at_each_declared_path_with_thinking_where_signed() -> None:
    backends = replay_backends("http://127.0.0.1:9/v1")
    for protocol in DECLARED:
        for stream in (False, True):
            backend = backends[replay_backend_name(protocol.name, stream)]
            assert backend["base_url"] == "http://127.0.0.1:9" + protocol.replay_path
            assert (backend["protocol"], backend["stream"]) == (protocol.name, stream)
            thinking = replay_backend_name(protocol.name, stream) + "-thinking"
            assert (thinking in backends) is protocol.replay.signed_thinking
    signed = sorted(p.name for p in DECLARED if p.replay.signed_thinking)
    assert signed == ["anthropic", "gemini"]


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


@pytest.mark.parametrize(
    ("name", "header", "value"),
    [
        ("openai", "authorization", "Bearer sk-9"),
        ("anthropic", "x-api-key", "sk-9"),
        ("gemini", "x-goog-api-key", "sk-9"),
        ("openai-text-tags", "authorization", "Bearer sk-9"),
    ],
)
def test_the_api_key_goes_in_the_declared_header(
    server: ScriptedServer, name: str, header: str, value: str
) -> None:
    backend = BackendConfig("b", name, server.base_url, api_key_env="KEY", max_attempts=1)
    provider = HttpProvider(backend, registry.codec_for(name), environ={"KEY": "sk-9"})
    server.script.append(Reply(status=400, body={"error": {"message": "no"}}))
    with pytest.raises(ProviderError):
        provider.complete(REQUEST)
    provider.close()
    sent = {k.lower(): v for k, v in server.seen[0].headers.items()}
    assert sent[header] == value
    others = {"authorization", "x-api-key", "x-goog-api-key"} - {header}
    assert not others & sent.keys()


def test_key_header_scheme() -> None:
    assert KeyHeader("Authorization", "Bearer").value("k") == "Bearer k"
    assert KeyHeader("x-api-key").value("k") == "k"


@pytest.mark.parametrize("protocol", [p for p in DECLARED if p.replay.own_entry], ids=_ids)
def test_a_turn_keeps_its_wire_copy_for_its_own_protocol_only(protocol: WireProtocol) -> None:
    copy = [{"wire": protocol.name}]
    turn = {"role": "assistant", "content": "x", "_provider": kept_for_replay(protocol, copy)}
    assert turn["_provider"] == {protocol.name: {protocol.replay.own_entry: copy}}
    assert own_replay(turn, protocol) is copy
    for other in DECLARED:
        if other is not protocol:
            assert own_replay(turn, other) is None


def test_a_protocol_without_an_own_entry_keeps_no_copy() -> None:
    openai = declared("openai")
    assert openai.replay.own_entry is None
    with pytest.raises(ValueError, match="keeps no wire copy"):
        kept_for_replay(openai, [])
    assert own_replay({"_provider": {"openai": {"content": "x"}}}, openai) is None


def test_replay_models_name_a_scenario_per_protocol() -> None:
    assert {p.name: p.replay_model_for("call") for p in DECLARED} == {
        "openai": "replay/call",
        "anthropic": "replay/call",
        "gemini": "replay-call",
        "openai-text-tags": "replay-tags/call",
    }


SYSTEM_PARTS: list[Any] = [
    {"type": "text", "text": "Be "},
    {"type": "image_url", "image_url": {"url": "https://h/x.png"}},
    "bare string",
    {"type": "text", "text": 5},
    {"type": "text", "text": "brief."},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
NO_TEXT = [{"type": "image_url", "image_url": {"url": "https://h/x.png"}}]
TRANSCRIPT: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM_PARTS},
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": NO_TEXT},
]


def test_the_codecs_that_flatten_content_parts_read_the_same_text() -> None:
    request = ChatRequest(model="m", messages=TRANSCRIPT)
    anthropic = registry.codec_for("anthropic").encode(request).body
    assert anthropic["system"] == "Be brief."
    assert anthropic["messages"][-1]["content"][0]["content"] == "(no output)"
    gemini = registry.codec_for("gemini").encode(request).body
    assert gemini["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    response = gemini["contents"][-1]["parts"][0]["functionResponse"]["response"]
    assert response == {"content": "(no output)"}
    tags = registry.codec_for("openai-text-tags").encode(request).body["messages"]
    assert tags[0] == {"role": "system", "content": "Be brief."}
    assert '{"name": "f", "content": "(no output)"}' in tags[-1]["content"]
