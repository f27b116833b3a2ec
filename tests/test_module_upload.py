"""A spec's WASM module goes to Redis once (content-addressed): a later submit naming it keeps it
alive with one EXPIRE and sends its bytes only when Redis lacks it, checking then that its file
still hashes as it did when its spec was checked."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from fixtures.demo_scenarios import WEATHER
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_from_objects
from producer.stored_specs import ModuleChangedError, compact
from schemas import keys
from tests.test_pipeline import _unique_module

pytestmark = pytest.mark.fleet
REDIS_DB = 13


def _sent(client: Client) -> list[tuple[Any, ...]]:
    """Every command the client's pipelines send from now on."""
    sent: list[tuple[Any, ...]] = []
    make = client.redis.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make(*args, **kwargs)
        execute = pipe.execute

        def recorded(*a: Any, **k: Any) -> Any:
            sent.extend(tuple(command) for command, _ in pipe.command_stack)
            return execute(*a, **k)

        pipe.execute = recorded
        return pipe

    client.redis.pipeline = pipeline
    return sent


def test_a_module_is_sent_once_and_kept_alive_after(base_fleet: Fleet, tmp_path: Path) -> None:
    module = _unique_module(tmp_path, uuid.uuid4().hex[:8])  # a module of this test's own
    sha = hashlib.sha256(module.read_bytes()).hexdigest()
    (spec,) = load_spec_from_objects([{
        "id": "w", "model": "replay/weather",
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [{**WEATHER, "module": str(module)}],
    }])  # fmt: skip
    client = Client(base_fleet.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}", ttl_s=600)
    try:
        sent = _sent(client)
        assert client.upload_modules([spec]) == {str(module): sha}
        assert client.redis.get(keys.module(sha)) == module.read_bytes()
        assert [c[0] for c in sent] == ["EXPIRE", "SET"]  # not there yet: sent

        validated = compact([spec])  # hashed now, as a spec file's line is when checked
        module.write_bytes(b"changed after the check")
        client.redis.expire(keys.module(sha), 5)
        sent.clear()
        client.upload_modules(validated)
        assert [c[0] for c in sent] == ["EXPIRE"]  # there: kept alive, its bytes not sent
        assert 5 < client.redis.ttl(keys.module(sha)) <= 600

        client.redis.delete(keys.module(sha))  # gone: the file must be what was checked
        with pytest.raises(ModuleChangedError):
            client.upload_modules(validated)
    finally:
        client.redis.delete(keys.module(sha))
        client.close()
