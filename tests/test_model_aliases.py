"""Model aliases (`models` in the fleet's configuration): their validation, each problem by its
dotted path; the one routing function (schemas/model_routes.py), where an explicit provider
wins; the model call and the session's backend routed by it on the worker; and the checks of
submit and `cchatq config check`. No Redis: the fleet test is tests/test_model_aliases_fleet.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.backend_check import backend_check
from producer.specfile import SpecFileError, load_spec_file, load_spec_from_objects
from schemas.config import ConfigError, parse_config
from schemas.model_routes import ModelAlias, ModelRoute, route_model
from schemas.spec_types import SessionSpec
from tests.test_config import cli, spec, write
from worker.codecs.protocol import ChatRequest
from worker.config import BackendConfig
from worker.session.engine import next_call
from worker.session.model_call import ModelCaller
from worker.session.state import Session

MINI = {"backend": "replay", "model": "replay/plain", "params": {"temperature": 0}}
ALIASES = {"gpt-4o-mini": ModelAlias("gpt-4o-mini", "replay", "replay/plain", {"top_p": 1})}


def problems(raw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return [f"{path}: {message}" for path, message in info.value.problems]


def test_an_alias_loads_with_its_backend_model_and_params() -> None:
    config = parse_config(
        {
            "backends": {"mine": {"base_url": "http://gpu-box:8000/v1"}},
            "models": {"gpt-4o-mini": MINI, "fast": {"backend": "mine", "model": "llama-3"}},
        }
    )
    assert config.models == {
        "gpt-4o-mini": ModelAlias("gpt-4o-mini", "replay", "replay/plain", {"temperature": 0}),
        "fast": ModelAlias("fast", "mine", "llama-3", {}),
    }
    assert parse_config({}).models == {}


def test_each_problem_of_an_alias_is_named_by_its_path() -> None:
    found = problems(
        {
            "models": {
                "a": {"backend": "nowhere", "model": "m"},
                "b": {"model": "m", "colour": "blue"},
                "c": {"backend": "replay", "model": "", "params": {"model": "x", "stream": 1}},
                "d": {"backend": "replay", "model": "m", "params": {"tool_choice": "none"}},
                "e": "replay",
                "": {"backend": "replay", "model": "m"},
            }
        }
    )
    assert found == [
        "models.: Shorter than minimum length 1.",
        "models.b.backend: Missing data for required field.",
        "models.b.colour: unknown key",
        "models.c.model: Shorter than minimum length 1.",
        "models.c.params.model: set by the spec or the worker, not params",
        "models.c.params.stream: set by the spec or the worker, not params",
        "models.d.params.tool_choice: set by the spec or the worker, not params",
        "models.e: Invalid input type.",
        "models.a.backend: 'nowhere' is not a backend",
    ]
    # a backend the same document configures is known to its aliases
    configured = {"backends": {"mine": {"base_url": "http://h/v1"}}}
    assert parse_config({**configured, "models": {"x": {"backend": "mine", "model": "m"}}})


def test_an_alias_routes_a_model_only_when_no_provider_is_named() -> None:
    params = {"temperature": 0.5, "top_p": 0.2}
    assert route_model(ALIASES, None, "gpt-4o-mini", params) == ModelRoute(
        "replay", "replay/plain", {"top_p": 0.2, "temperature": 0.5}, "gpt-4o-mini"
    )  # the spec's own params win over the alias's
    assert route_model(ALIASES, None, "gpt-4o-mini").params == {"top_p": 1}
    # an explicit provider wins: the name goes to it as it is
    assert route_model(ALIASES, "openai", "gpt-4o-mini", params) == ModelRoute(
        "openai", "gpt-4o-mini", params
    )
    assert route_model(ALIASES, None, "replay/call") == ModelRoute(None, "replay/call", {})
    # aliases do not chain: the upstream model is sent as it is
    chained = {**ALIASES, "replay/plain": ModelAlias("replay/plain", "openai", "gpt-4o")}
    assert route_model(chained, None, "gpt-4o-mini").model == "replay/plain"


class Recording(ModelCaller):
    """The model caller, its calls recorded instead of made (rate control is not what this is
    about)."""

    def __init__(self) -> None:
        config = parse_config({"models": {"gpt-4o-mini": MINI}})
        super().__init__(
            backends=config.backends,
            default_backend="openai",
            provider_for=lambda backend: None,  # type: ignore[arg-type,return-value]
            rate_limiter=None,  # type: ignore[arg-type]
            store=None,  # type: ignore[arg-type]
            control=None,  # type: ignore[arg-type]
            models=config.models,
        )
        self.calls: list[tuple[str, ChatRequest]] = []

    def complete(
        self,
        backend: BackendConfig,
        chat: ChatRequest,
        partial_of: str | None = None,
        waiter: str = "",
    ) -> dict[str, Any]:
        self.calls.append((backend.name, chat))
        return {"model": chat.model, "choices": []}


def session(**fields: Any) -> Session:
    spec = SessionSpec(
        id="s", model="gpt-4o-mini", messages=({"role": "user", "content": "hi"},), **fields
    )
    return Session(spec=spec, backend=spec.provider or "openai")


def test_a_rounds_model_call_goes_where_the_alias_routes_it() -> None:
    recording = models = Recording()
    aliased = session(params={"temperature": 0.7})
    reply = models.call_round("sk", aliased, next_call(aliased))
    backend, chat = recording.calls[-1]
    assert (backend, chat.model, chat.params) == ("replay", "replay/plain", {"temperature": 0.7})
    assert reply["model"] == "replay/plain"  # what the provider reports: `_spear.model`
    explicit = session(provider="anthropic")
    models.call_round("sk", explicit, next_call(explicit))
    assert (recording.calls[-1][0], recording.calls[-1][1].model) == ("anthropic", "gpt-4o-mini")
    assert models.route(None, "gpt-4o-mini").backend == "replay"


def test_submit_checks_the_backend_an_alias_routes_to(tmp_path: Path) -> None:
    configured = parse_config(
        {"models": {"gpt-4o-mini": {"backend": "openai", "model": "gpt-4o-mini-2024-07-18"}}}
    )
    check = backend_check(configured, {})
    path = write(
        tmp_path / "specs.jsonl",
        spec("a", model="gpt-4o-mini"),
        spec("b", model="gpt-4o-mini", provider="replay"),  # explicit: no alias, no key
        spec("c", model="replay/plain"),
    )
    with pytest.raises(SpecFileError) as info:
        load_spec_file(path, check)
    assert [(p.line, p.field, p.message) for p in info.value.issues] == [
        (
            1,
            "model",
            "backend 'openai' (model alias 'gpt-4o-mini', models.gpt-4o-mini.backend) reads its"
            " API key from $OPENAI_API_KEY, which is not set (--no-key-check when only the"
            " workers hold it)",
        )
    ]
    assert load_spec_file(path, backend_check(configured, {"OPENAI_API_KEY": "k"}))
    # a program run asking for the alias is checked alike
    program = {"id": "p", "program": {"module": "prog_chat_timeout.wasm"}, "model": "gpt-4o-mini"}
    with pytest.raises(SpecFileError, match="model alias 'gpt-4o-mini'"):
        load_spec_from_objects([program], check=check)


def test_config_check_lists_the_aliases_and_refuses_one_on_an_unknown_backend() -> None:
    config = {"models": {"gpt-4o-mini": MINI}}
    shown = cli("config", "check", env={"CCHATQ_BACKENDS": json.dumps(config)})
    assert shown.returncode == 0, shown.stderr
    assert "  model gpt-4o-mini        -> replay replay/plain" in shown.stdout.splitlines()
    bad = {"models": {"gpt-4o-mini": {**MINI, "backend": "replya"}}}
    refused = cli("config", "check", env={"CCHATQ_BACKENDS": json.dumps(bad)})
    assert refused.returncode == 2
    assert "  models.gpt-4o-mini.backend: 'replya' is not a backend" in refused.stderr
