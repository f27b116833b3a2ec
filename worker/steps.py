"""The steps of a session: start, round, tool, finish. Each runs at least once, so each is
idempotent: a step id, a lease while it runs, first-writer-wins outputs, and a `published`
marker set after its continuation is sent. A redelivered step that finds its work done
re-publishes its continuation; duplicates of a step are absorbed by these guards.

Celery is not imported here: tasks call these methods and turn `RetryLater` into a retry.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from schemas import keys
from schemas.bodies import dump_body, error_obj, is_error_body
from worker.codecs.openai_chat import tool_calls_of
from worker.codecs.protocol import ChatRequest, Delta
from worker.config import BackendConfig, Settings
from worker.edges.dispatch import Dispatcher
from worker.edges.rate_limit import Permit, RateLimiter
from worker.edges.store import RedisStore
from worker.edges.wasm_fork import ProgramFork
from worker.edges.wasm_runtime import ToolInvocation, WasmToolRuntime
from worker.engine import (
    CANCELLED,
    CallModel,
    Finish,
    Round,
    RunTools,
    Session,
    ToolOutcome,
    canonical_arguments,
    metrics,
    plan,
    transcript,
)
from worker.errors import GuestError, ProviderError, StoreError, ToolError

log = logging.getLogger(__name__)

START_LEASE_MS = 60_000
FINISH_LEASE_MS = 30_000
PARTIAL_EVERY_S = 0.25


class RateLimited(Exception):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"rate limited for {wait_s:.2f} s")
        self.wait_s = wait_s


class PartialText:
    """The text of a streamed round, published every PARTIAL_EVERY_S for `cchatq status`."""

    def __init__(self, store: RedisStore, sk: str) -> None:
        self.store, self.sk = store, sk
        self.text: list[str] = []
        self.last = 0.0

    def __call__(self, delta: Delta) -> None:
        if delta.kind == "restart":
            self.text.clear()
            return
        if delta.kind != "content":
            return
        self.text.append(delta.text)
        if time.monotonic() - self.last >= PARTIAL_EVERY_S:
            self.last = time.monotonic()
            self.store.set_partial(self.sk, "".join(self.text))

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.store.set_partial(self.sk, None)


def estimate_tokens(chat: ChatRequest) -> int:
    """A prompt's size in tokens, roughly (4 characters a token), before the call."""
    return len(json.dumps(chat.messages, ensure_ascii=False)) // 4 + 1


class RetryLater(Exception):
    def __init__(self, countdown_s: float, reason: str) -> None:
        super().__init__(reason)
        self.countdown_s = countdown_s


class CompletionProvider(Protocol):
    def complete(
        self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
    ) -> Any: ...


@dataclass
class StepRunner:
    store: RedisStore
    dispatch: Dispatcher
    provider_for: Callable[[BackendConfig], CompletionProvider]
    runtime: Callable[[], WasmToolRuntime]
    settings: Settings
    fork_blob: Callable[[str], bytes]  # a program's memory snapshot, for its tools' forks
    rate_limiter: RateLimiter

    # guards --------------------------------------------------------------------------------

    def guarded(
        self,
        step: str,
        sk: str,
        lease_ms: int,
        body: Callable[[], None],
        stop_if_cancelled: bool = True,
        targets: Callable[[], list[str]] | None = None,
        **meta: str | int,
    ) -> None:
        """Run one delivery of a step under its guards. A step that keeps failing ends the
        sessions `targets()` names (its own session by default)."""
        sessions = targets or (lambda: [sk])
        start = self.store.begin_step(step, lease_ms, dict(meta), sk)
        if start.published:
            return
        if not start.leased:
            raise RetryLater(self.store.lease_left_ms(step) / 1000 + 0.05, f"step {step} is leased")
        if start.cancelled and stop_if_cancelled:
            # cancellation is checked at every step boundary; finish writes the cancelled body
            self.dispatch.finish(sk)
            self.store.end_step(step)
            return
        if start.tries > self.settings.max_step_attempts:
            self.poison(step, sessions(), f"delivered {start.tries} times")
            return
        try:
            body()
        except RateLimited as exc:
            # waiting for the backend's rate limit is not a failure: no try is spent, and the
            # task gives its worker slot back until there may be room
            self._release_quietly(step)
            self.store.uncount_try(step)
            raise RetryLater(exc.wait_s, "rate limited") from None
        except Exception as exc:
            self._release_quietly(step)
            if start.tries >= self.settings.max_step_attempts:
                self.poison(step, sessions(), f"{type(exc).__name__}: {exc}")
                return
            log.warning("step %s failed (try %d): %s", step, start.tries, type(exc).__name__)
            raise RetryLater(
                min(0.2 * 2**start.tries, 10.0), f"{type(exc).__name__}: {exc}"
            ) from exc
        self.store.end_step(step)

    def _release_quietly(self, step: str) -> None:
        with contextlib.suppress(StoreError):
            self.store.release_lease(step)

    def poison(self, step: str, sks: list[str], reason: str) -> None:
        """A step that keeps failing ends its sessions: dead-letter it, finish with an error."""
        body = error_obj("step_failed", f"step {step} failed for good: {reason}"[:500])
        for sk in sks:
            self.store.dead_letter(step, sk, body, reason)
            self.dispatch.finish(sk)
        self.store.end_step(step)

    def _default_backend(self) -> str:
        return self.settings.default_backend

    # start ---------------------------------------------------------------------------------

    def start(self, batch: str, chunk_no: int) -> None:
        def members() -> list[str]:
            return self.store.chunk_members(batch, chunk_no)

        def body() -> None:
            for member in members():
                if member.startswith("p:"):  # a program run
                    self.dispatch.program(member[2:])
                else:
                    self.dispatch.round(member, 0)

        def sessions() -> list[str]:
            return [m.removeprefix("p:") for m in members()]

        # sk "": a chunk is no session (no cancel flag, no meta); its poison ends them all
        self.guarded(keys.start_step(batch, chunk_no), "", START_LEASE_MS, body, targets=sessions)

    # round ---------------------------------------------------------------------------------

    def round(self, sk: str, round_no: int) -> None:
        backend = self._backend(self.store.load_spec(sk))
        lease_ms = int((backend.total_timeout_s if backend else 60) * 1000) + 10_000

        def body() -> None:
            session = self.store.load_session(sk, self._default_backend(), upto_round=round_no)
            if len(session.rounds) <= round_no:
                step = plan(session)
                if not isinstance(step, CallModel) or step.round_no != round_no:
                    return  # a stale duplicate: the session is past this round
                reply = self._call_model(sk, session, backend, step)
                winner = self.store.store_model_reply(sk, round_no, reply)
                session = replace(session, rounds=(*session.rounds, Round(reply=winner)))
            self._continue(sk, session)

        self.guarded(keys.round_step(sk, round_no), sk, lease_ms, body, state=f"round {round_no}")

    def _backend(self, spec: dict[str, Any]) -> BackendConfig | None:
        try:
            return self.settings.backend(spec.get("provider"))
        except (KeyError, TypeError):  # unknown, or not a name at all: the round ends it
            return None

    def _call_model(
        self, sk: str, session: Session, backend: BackendConfig | None, step: CallModel
    ) -> dict[str, Any]:
        if backend is None:
            name = session.spec.get("provider")
            return error_obj(
                "provider_error",
                f"unknown backend {name!r}; configured: {sorted(self.settings.backends)}",
            )
        chat = ChatRequest(
            model=step.model,
            messages=step.messages,
            tools=step.tools,
            params=step.params,
            tool_choice=step.tool_choice,
            parallel_tool_calls=step.parallel_tool_calls,
            stream=backend.stream,
            thinking_budget_tokens=backend.thinking_budget_tokens,
        )
        permit = self.rate_limiter.acquire(backend, estimate_tokens(chat))
        if not isinstance(permit, Permit):
            raise RateLimited(permit)
        partial = PartialText(self.store, sk) if backend.stream else None
        try:
            reply = dict(self.provider_for(backend).complete(chat, partial).completion)
        except ProviderError as exc:
            return error_obj(exc.code, exc.message)
        finally:
            if partial is not None:
                partial.close()
        self.rate_limiter.settle(permit, int((reply.get("usage") or {}).get("total_tokens", 0)))
        return reply

    def _continue(self, sk: str, session: Session) -> None:
        """Publish what follows a stored model reply."""
        step = plan(session)
        if isinstance(step, Finish):
            self.dispatch.finish(sk)
        elif isinstance(step, CallModel):
            self.dispatch.round(sk, step.round_no)
        elif isinstance(step, RunTools):
            done = (
                self.store.store_tool_outcomes(sk, step.round_no, step.presets)
                if step.presets
                else 0
            )
            for run in step.runs:
                self.dispatch.tool(sk, step.round_no, run.index)
            if not step.runs and done >= step.call_count:
                self.dispatch.round(sk, step.round_no + 1)

    # tool ----------------------------------------------------------------------------------

    def tool(self, sk: str, round_no: int, index: int) -> None:
        spec = self.store.load_spec(sk)
        limits = Session(spec=spec, backend="").limits

        def body() -> None:
            reply, outcome = self.store.tool_inputs(sk, round_no, index)
            if reply is None or is_error_body(reply):
                raise StoreError(f"round {round_no} reply missing for tool step")
            calls = tool_calls_of(reply)
            if outcome is None:
                outcome = self._execute(spec, calls[index], limits.as_dict())
            done = self.store.store_tool_outcomes(sk, round_no, {index: outcome})
            if done >= len(calls):
                self.dispatch.round(sk, round_no + 1)

        lease_ms = limits.tool_timeout_ms + 5_000  # the deadline covers an ENOSPC retry too
        self.guarded(keys.tool_step(sk, round_no, index), sk, lease_ms, body)

    def _execute(
        self, spec: dict[str, Any], call: dict[str, Any], limits: dict[str, int]
    ) -> ToolOutcome:
        name = call["function"]["name"]
        tool = next(t for t in spec["tools"] if t["function"]["name"] == name)
        try:
            fork_sha = tool.get("fork_sha256")
            fork = ProgramFork.from_blob(self.fork_blob(fork_sha)) if fork_sha else None
            invocation = ToolInvocation(
                module_sha256=tool["module_sha256"],
                export=tool.get("export"),
                table_index=tool.get("table_index"),
                arguments=canonical_arguments(call["function"]["arguments"]).encode(),
                timeout_ms=limits["tool_timeout_ms"],
                memory_bytes=limits["tool_memory_bytes"],
                max_output_bytes=limits["max_tool_output_bytes"],
                fork=fork,
            )
            return ToolOutcome(content=self.runtime().call_tool(invocation), ok=True)
        except ToolError as exc:
            return ToolOutcome.error(exc.code, exc.message)
        except GuestError as exc:
            return ToolOutcome.error("tool_exec_failed", exc.message)

    # nudge ------------------------------------------------------------------------------

    def nudge(self, sk: str) -> None:
        """Re-publish what a stalled session does next, as the engine plans it from the stored
        state. A broker can lose a message (a worker killed between taking it and recording it
        as unacknowledged); every step being idempotent, publishing it again is always safe."""
        if self.store.has_result(sk):
            self.store.notify(sk, self.store.watcher_batches(sk))
            return
        spec = self.store.load_spec(sk)
        if spec.get("kind") == "program":
            self.dispatch.program(sk)
            return
        step = plan(self.store.load_session(sk, self._default_backend()))
        if isinstance(step, CallModel):
            self.dispatch.round(sk, step.round_no)
        elif isinstance(step, RunTools):
            for run in step.runs:
                self.dispatch.tool(sk, step.round_no, run.index)
            if not step.runs:
                self.dispatch.round(sk, step.round_no)  # its presets are still to be stored
        else:
            self.dispatch.finish(sk)

    # finish --------------------------------------------------------------------------------

    def finish(self, sk: str) -> None:
        def body() -> None:
            spec = self.store.load_spec(sk)
            failure = self.store.failure(sk)
            if spec.get("kind") == "program":  # only a failed run is finished here
                body = failure or error_obj("cancelled", "program run cancelled")
                self.store.write_result(sk, dump_body(body), failed_program_record(spec, body))
                return
            session = self.store.load_session(sk, self._default_backend())
            missing: ToolOutcome | None = None
            if failure is not None:
                result, missing = (
                    failure,
                    ToolOutcome.error("step_failed", "session failed before this call ran"),
                )
            elif self.store.is_cancelled(sk):
                result, missing = error_obj("cancelled", "session cancelled"), CANCELLED
            else:
                step = plan(session)
                if isinstance(step, Finish):
                    result = step.body
                else:
                    result, missing = (
                        error_obj("internal_error", "finish before the session ended"),
                        CANCELLED,
                    )
            meta = self.store.meta(sk)
            latency_ms = int(time.time() * 1000) - int(meta.get("submitted_ms", "0") or 0)
            want_metrics = session.flags.get("metrics", True)
            record = {
                "id": session.spec["id"],
                "status": "error" if is_error_body(result) else "ok",
                "body": result,
                "transcript": transcript(session, missing),
                "metrics": metrics(session, latency_ms) if want_metrics else {},
            }
            self.store.write_result(sk, dump_body(result), record)

        self.guarded(keys.finish_step(sk), sk, FINISH_LEASE_MS, body, stop_if_cancelled=False)


def failed_program_record(spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A program run that ended without running to its end (dead-lettered or cancelled)."""
    return {
        "id": spec["id"], "kind": "program", "status": "error", "body": body, "exit_code": None,
        "stdout": "", "stderr": "", "logs": [], "responses": [], "metrics": {},
    }  # fmt: skip
