"""The ToolRuntime port in memory: Python functions as tools, or none at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from worker.errors import ToolRuntimeError
from worker.session.ports import ToolCall


class NoTools:
    """The ToolRuntime port of a process that runs no tools."""

    def run(self, call: ToolCall) -> str:
        raise ToolRuntimeError("this twin runs no tools")


@dataclass
class PythonTools:
    """The ToolRuntime port running Python functions by export name: text in, text out."""

    functions: dict[str, Callable[[str], str]]
    calls: list[ToolCall] = field(default_factory=list)

    def run(self, call: ToolCall) -> str:
        self.calls.append(call)
        function = self.functions.get(call.export or "")
        if function is None:
            raise ToolRuntimeError(f"no function {call.export!r} in this twin")
        return function(call.arguments.decode())
