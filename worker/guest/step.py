"""The program step: one WASM agent program run, on the `programs` queue (a pool of its own:
a program waits on chats that run on the llm/tools/control queues, so sharing their pool could
deadlock a full one). Guarded like every step; its result lands in the run's response fd."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from schemas import keys
from schemas.bodies import error_obj
from schemas.spec_types import ProgramSpec
from worker.errors import CancelledError
from worker.guest.host import ChatDefaults, ProgramHost
from worker.guest.mcp_params import McpAccess
from worker.guest.ports import ProgramStore
from worker.guest.runner import ModuleSource, ProgramOutcome, ProgramRun, run_program
from worker.session.decisions import WriteEnding
from worker.session.ending import Ending, failed_program_record
from worker.session.ports import Outbox
from worker.session.steps import StepRunner
from worker.session.store_ports import StepStart
from worker.session.trace import Arrival


@dataclass
class ProgramSteps:
    runner: StepRunner
    programs: ProgramStore
    source: ModuleSource

    def program(
        self, sk: str, first: bool | None = None, arrival: Arrival | None = None
    ) -> str | None:
        def body(_: StepStart, outbox: Outbox) -> None:
            spec = self.runner.spec_of(sk, ProgramSpec)
            started = time.monotonic()
            if self.programs.is_cancelled(sk):
                record = cancelled_record(spec)
            else:
                host = ProgramHost(
                    ChatDefaults(
                        run_id=spec.id,
                        run_sk=sk,
                        module_sha256=spec.program.module_sha256,
                        backend=spec.provider,
                        model=spec.model,
                        deadline=started + spec.limits.run_timeout_ms / 1000,
                        permissions=spec.permissions,
                        mcp=self._mcp_access(spec),
                    ),
                    self.programs,
                    self.runner.dispatch,
                )
                outcome = run_program(self.source, _run_of(spec), host)
                record = program_record(
                    spec, outcome, host, int((time.monotonic() - started) * 1000)
                )
            self.runner.apply(sk, WriteEnding(Ending(record["body"], record)), outbox)

        step = keys.program_step(sk)
        return self.runner.guard.run(
            step, sk, body, stop_if_cancelled=False, first=first, arrival=arrival, state="running"
        )

    def _mcp_access(self, spec: ProgramSpec) -> McpAccess:
        """The MCP servers the run's environment allows its chats to enable."""
        fleet = self.runner.settings.fleet.tool_defaults
        allowed = fleet.mcp_allowed(spec.permissions.environment)
        return McpAccess(allowed=allowed, client=self.runner.mcp, fleet=fleet)


def _run_of(spec: ProgramSpec) -> ProgramRun:
    return ProgramRun(
        module_sha256=spec.program.module_sha256,
        args=list(spec.program.args),
        stdin=spec.program.stdin.encode(),
        env=dict(spec.program.env),
        timeout_ms=spec.limits.run_timeout_ms,
        memory_bytes=spec.limits.memory_bytes,
        max_output_bytes=spec.limits.max_output_bytes,
    )


def program_record(
    spec: ProgramSpec, outcome: ProgramOutcome, host: ProgramHost, latency_ms: int
) -> dict[str, Any]:
    if outcome.error_code is not None:
        body = error_obj(outcome.error_code, outcome.error or outcome.error_code)
    else:
        body = {"exit_code": outcome.exit_code}
    ok = outcome.error_code is None and outcome.exit_code == 0
    responses = host.response_bodies()  # first: a chat seen ended only now adds its tool lines
    return {
        "id": spec.id,
        "kind": "program",
        "status": "ok" if ok else "error",
        "body": body,
        "exit_code": outcome.exit_code,
        "stdout": outcome.stdout.decode(errors="replace"),
        "stderr": outcome.stderr.decode(errors="replace"),
        "logs": host.logs,  # its own lines and, where it saw each chat end, the chat's tools'
        "responses": responses,
        "metrics": {"latency_ms": latency_ms, "chats": host.sends},
    }


def cancelled_record(spec: ProgramSpec) -> dict[str, Any]:
    return failed_program_record(spec, CancelledError("program run cancelled").body())
