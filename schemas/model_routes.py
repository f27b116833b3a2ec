"""Model aliases: a model name a spec or program asks for, mapped by the fleet's configuration
(`models`, schemas/config.py) to one of its backends, the model that backend knows it by, and
params merged under the spec's own:

    "models": {"gpt-4o-mini": {"backend": "replay", "model": "replay/plain",
                               "params": {"temperature": 0}}}

An alias applies only to a spec (or program chat) that names no `provider` (a program chat: no
`backend` param, and none in its program's spec). An explicit provider is the spec saying where
its model goes, so it wins and the model name goes to that backend as it is: a spec can still
reach the real `gpt-4o-mini` on `openai` while the fleet aliases the name elsewhere, and an
alias never changes where an existing spec with a provider goes. Aliases do not chain: the
upstream model is sent as it is, whatever the configuration calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the spec's own tool choices, not a model's: an alias cannot set them
TOOL_CHOICE_PARAMS = ("tool_choice", "parallel_tool_calls")


@dataclass(frozen=True)
class ModelAlias:
    name: str  # what a spec or program asks for
    backend: str  # a backend of the configuration
    model: str  # the upstream model, as that backend knows it
    params: Mapping[str, Any] = field(default_factory=dict)  # under the spec's own


@dataclass(frozen=True)
class ModelRoute:
    """Where a model call goes: its backend (None: the fleet's default), the model it asks
    that backend for, the params it sends, and the alias it went through (None: no alias)."""

    backend: str | None
    model: str
    params: dict[str, Any]
    alias: str | None = None


def route_model(
    models: Mapping[str, ModelAlias],
    provider: str | None,
    model: str,
    params: Mapping[str, Any] | None = None,
) -> ModelRoute:
    """The route of a call naming `provider` (None: unset) and `model`, with `params`."""
    alias = None if provider else models.get(model)
    if alias is None:
        return ModelRoute(provider or None, model, dict(params or {}))
    return ModelRoute(alias.backend, alias.model, {**alias.params, **(params or {})}, alias.name)
