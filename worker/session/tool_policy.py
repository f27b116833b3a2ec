"""How one tool call runs under its policy (the README's "Tool calls": Policy): its timeout, its
retries with exponential backoff, idempotency, and a fallback tool; the outcome carries its
latency and retry count. Runs through the ToolRuntime port, so the twins test it with no
wasmtime."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from schemas.fleet import ToolDefaults
from schemas.limits import BACKGROUND_TIMEOUT_CAP_MS, RETRY_BACKOFF_CAP_MS, Limits
from schemas.spec_types import SessionSpec, ToolSpec
from schemas.tool_policy import resolve
from worker.errors import GuestError, ToolError, ToolRuntimeError
from worker.session.engine import ToolRun, argument_problem
from worker.session.outcomes import ToolOutcome
from worker.session.permissions import permission_problem
from worker.session.ports import CallWatcher, ToolCall, ToolRuntime
from worker.session.tool_logs import ToolLogs

# A tool step's retries stop where one more attempt could outlive this (the task time limit,
# CCHATQ_VISIBILITY_TIMEOUT_S, defaults to 300 s); a background tool's, at its own cap.
STEP_BUDGET_MS = 240_000
BACKGROUND_BUDGET_MS = BACKGROUND_TIMEOUT_CAP_MS


@dataclass(frozen=True)
class CallPolicy:
    """The fields of a tool's policy the caller reads, with every default resolved: each
    comes from the declaration's field of the same name (schemas.tool_policy.resolve)."""

    timeout_ms: int
    max_retries: int
    retry_backoff_ms: int
    idempotent: bool

    def backoff_ms(self, retry: int) -> int:
        """The wait before retry number `retry` (1, 2, ...): doubling, capped."""
        return int(min(self.retry_backoff_ms * 2 ** (retry - 1), RETRY_BACKOFF_CAP_MS))


def call_policy(tool: ToolSpec, limits: Limits, fleet: ToolDefaults) -> CallPolicy:
    """The tool's own policy, else the session's limits, else the fleet's defaults."""
    values = resolve(tool.policy, limits, fleet)
    return CallPolicy(**{name: values[name] for name in _CALL_FIELDS})


_CALL_FIELDS = tuple(f.name for f in fields(CallPolicy))


def budget_ms(tool: ToolSpec) -> int:
    """The longest a call of `tool` may take, retries and fallback included."""
    return BACKGROUND_BUDGET_MS if tool.policy.background else STEP_BUDGET_MS


@dataclass
class ToolCaller:
    """Runs a session's tool calls under their policies."""

    runtime: ToolRuntime
    fleet: ToolDefaults
    # told of each retry: the tool, the retry number about to run, the failure's class
    on_retry: Callable[[str, int, str], None] | None = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def run(
        self, spec: SessionSpec, run: ToolRun, watcher: CallWatcher | None = None
    ) -> ToolOutcome:
        """Run the call; `watcher` hears its progress reports and may stop it."""
        started = self.clock()
        deadline = started + budget_ms(run.tool) / 1000
        logs = ToolLogs()  # the call's, over its retries and its fallback
        outcome = self._with_retries(spec, run.tool, run.arguments, deadline, watcher, logs)
        fallback = spec.tool(run.tool.policy.fallback) if run.tool.policy.fallback else None
        if fallback is not None and permission_problem(fallback, spec.permissions, self.fleet):
            fallback = None  # a fallback is no way around a denial
        # the arguments were checked against the primary's schema; the fallback's may differ
        if (
            not outcome.ok
            and fallback is not None
            and argument_problem(run.arguments, fallback.function.parameters) is None
        ):
            # its log lines go on counting the call's attempts after the primary's
            first = outcome.retries + 1
            second = self._with_retries(
                spec, fallback, run.arguments, deadline, watcher, logs, first
            )
            outcome = replace(
                second, retries=outcome.retries + second.retries, fallback=fallback.name
            )
        return replace(
            outcome,
            latency_ms=round((self.clock() - started) * 1000),
            logs=tuple(logs.lines),
            dropped_logs=logs.dropped,
        )

    def _with_retries(
        self,
        spec: SessionSpec,
        tool: ToolSpec,
        arguments: str,
        deadline: float,
        watcher: CallWatcher | None,
        logs: ToolLogs,
        first_attempt: int = 0,
    ) -> ToolOutcome:
        policy = call_policy(tool, spec.limits, self.fleet)
        limits = spec.limits
        retry = 0
        while True:
            call = ToolCall(
                module_sha256=tool.module_sha256,
                export=tool.export,
                table_index=tool.table_index,
                fork_sha256=tool.fork_sha256,
                arguments=arguments.encode(),
                timeout_ms=policy.timeout_ms,
                memory_bytes=limits.tool_memory_bytes,
                max_output_bytes=limits.max_tool_output_bytes,
                attempt=retry,
                watcher=watcher,
                logs=logs,
                mcp=tool.mcp,
            )
            logs.attempt = first_attempt + retry
            try:
                return ToolOutcome.success(self.runtime.run(call), retries=retry)
            except ToolError as exc:
                error = exc
            except GuestError as exc:  # the module could not load: the tool never ran
                error = ToolRuntimeError(exc.message, ran=False)
            wait_s = policy.backoff_ms(retry + 1) / 1000
            out_of_time = self.clock() + wait_s + policy.timeout_ms / 1000 > deadline
            if (
                retry >= policy.max_retries
                or not error.retryable
                or (error.ran and not policy.idempotent)
                or out_of_time
            ):
                return ToolOutcome.error(error, retries=retry)
            retry += 1
            if self.on_retry is not None:
                self.on_retry(tool.name, retry, error.code)
            self.sleep(wait_s)
