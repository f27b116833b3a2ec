"""A chat session's state as a step reads it: its spec and, per round, the model's reply and
the tool outcomes stored so far. What the engine plans from and the transcript is made of."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.fleet import ToolDefaults
from schemas.limits import Limits
from schemas.spec_types import Flags, SessionSpec, ToolSpec
from worker.codecs.reply import Reply
from worker.session.outcomes import ToolOutcome


@dataclass(frozen=True)
class Round:
    """One model call: its reply (a canonical chat.completion, or an error body) and the
    outcomes stored so far for its tool calls, by call index."""

    reply: Reply
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
