"""One error tree for the worker, the source of every error code. Foreign exceptions are
translated once, at their edge. A code that can reach a response body or a tool message is
defined here once (`code`), with the line that says when it is raised; the README's error
table lists them all (tests/test_errors.py keeps the two in step).

CchatqError                      root; `code` is the error-body code
├── SessionError                 ends a session with an error body
│   ├── ToolCallLimitError       tool_call_limit
│   ├── UnknownToolError         unknown_tool
│   ├── CancelledError           cancelled
│   ├── StepFailedError          step_failed
│   ├── InvalidRequestError      invalid_request
│   ├── DeadlineExceededError    deadline_exceeded
│   ├── McpError                 mcp_error
│   └── InternalError            internal_error
├── ToolError                    a tool call failed: an error tool message, the loop goes on
│   ├── ToolValidationError      VALIDATION_ERROR
│   ├── ToolNotFoundError        TOOL_NOT_FOUND
│   ├── ToolTimeoutError         TIMEOUT
│   ├── ToolRuntimeError         RUNTIME_ERROR
│   ├── ToolPermissionError      PERMISSION_DENIED
│   ├── ToolOutputTooLargeError  OUTPUT_TOO_LARGE
│   ├── RepeatedCallError        REPEATED_CALL
│   └── ToolNotRunError          NOT_RUN
├── ProviderError                provider_error (the model call failed)
│   ├── ProviderRetryableError   provider_unavailable
│   │   └── ProviderRateLimitedError  a 429 under adaptive rate control: its round waits
│   ├── ProviderRequestError     provider_error
│   ├── ProviderProtocolError    provider_protocol_error
│   └── ProviderTimeoutError     provider_timeout
├── GuestError                   guest_error
│   └── GuestTrapError           guest_trap
├── StoreError                   store_error (never in a body: the step is retried)
│   ├── SpecMissingError         a session's spec expired or was never submitted
│   ├── StoreUnavailableError    Redis refuses writes for now (full, failing to persist, a
│   │                            replica, loading): waited out, no try spent
│   ├── StoreUnreachableError    Redis did not answer (a cut network, a restart, a failover):
│   │                            a model's reply waiting to be stored is kept and written again
│   └── BrokerUnconfirmedError   RabbitMQ did not confirm a step's messages (unreachable, a
│                                nack, no queue took one): the step fails and is retried
└── StepControl                  not failures: how a step or a guest run changes course
    ├── RetryLater               run this delivery again later (Celery's retry)
    ├── StepDeadLettered         the step failed for good: its task ends as a FAILURE
    ├── RateLimited              no room under the backend's rate limit yet
    ├── RunAborted               a program run ends now (deadline, cancellation)
    └── GuestFault               a guest pointer out of bounds: the hostcall returns -EFAULT
"""

from __future__ import annotations

from typing import Any

from schemas.bodies import error_obj


class CchatqError(Exception):
    code: str = "internal_error"
    raised_when: str = "a bug or an inconsistent stored state"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message or self.code

    def body(self) -> dict[str, Any]:
        """The error body (or tool message) this error ends in."""
        return error_obj(self.code, self.message)


# Ending a session ---------------------------------------------------------------------------


class SessionError(CchatqError):
    code = "session_error"
    raised_when = "(abstract) a session ends with an error body"


class ToolCallLimitError(SessionError):
    code = "tool_call_limit"
    raised_when = "max_iterations or max_total_tool_calls would be exceeded by the next round"


class UnknownToolError(SessionError):
    code = "unknown_tool"
    raised_when = (
        "the model called a tool the spec does not define, with strict_unknown_tool "
        "(the session ends)"
    )


class CancelledError(SessionError):
    code = "cancelled"
    raised_when = (
        "`cchatq cancel` (or a program's cancel) took effect at a step boundary; a model or"
        " tool call in flight ends first, and its tokens count in the record's usage"
    )


class StepFailedError(SessionError):
    code = "step_failed"
    raised_when = "a step failed on every try (CCHATQ_MAX_STEP_ATTEMPTS); it is dead-lettered"


class InvalidRequestError(SessionError):
    code = "invalid_request"
    raised_when = "a program's chat cannot be routed (no model, a non-string backend)"


class DeadlineExceededError(SessionError):
    code = "deadline_exceeded"
    raised_when = (
        "a program run passed its run_timeout_ms, or a session showed no progress past the "
        "fleet's CCHATQ_SESSION_DEADLINE_S"
    )


class McpError(SessionError):
    code = "mcp_error"
    raised_when = (
        "an MCP server a session uses could not list its tools (not started, not reachable, "
        "timed out), or is not configured or allowed where the session runs"
    )


class InternalError(SessionError):
    code = "internal_error"
    raised_when = "a bug or an inconsistent stored state: the session still gets this body"


# A tool call's error message ----------------------------------------------------------------


class ToolError(CchatqError):
    """A failed tool call: the model gets its class (`code`, upper-case names)
    and message. `ran` says whether the tool may have run (a non-idempotent tool is retried
    only when it provably did not); `retryable` whether trying again can help at all."""

    code = "RUNTIME_ERROR"
    raised_when = "(abstract) a tool call failed; the model gets an error tool message"
    retryable = False
    ran_by_default = False  # the classes a running tool raises say True

    def __init__(self, message: str = "", ran: bool | None = None) -> None:
        super().__init__(message)
        self.ran = self.ran_by_default if ran is None else ran


class ToolValidationError(ToolError):
    code = "VALIDATION_ERROR"
    raised_when = (
        "the call's arguments are no JSON object, break the tool's schema, were cut off by the "
        "token limit, or the schema itself cannot be checked"
    )


class ToolNotFoundError(ToolError):
    code = "TOOL_NOT_FOUND"
    raised_when = "the model called a tool the session does not offer"


class ToolTimeoutError(ToolError):
    code = "TIMEOUT"
    raised_when = "the tool ran past its timeout_ms"
    retryable = True
    ran_by_default = True


class ToolRuntimeError(ToolError):
    code = "RUNTIME_ERROR"
    raised_when = (
        "the tool trapped, returned rc < 0, wrote bad UTF-8, hit its memory limit, or its "
        "module could not load; an MCP tool's result said isError, or "
        "its server failed or could not be reached"
    )
    retryable = True
    ran_by_default = True


class ToolPermissionError(ToolError):
    code = "PERMISSION_DENIED"
    raised_when = "the tool's risk level or an allow/deny rule forbids the call; it did not run"


class ToolOutputTooLargeError(ToolError):
    code = "OUTPUT_TOO_LARGE"
    raised_when = "the tool's output exceeds max_tool_output_bytes"
    ran_by_default = True


class RepeatedCallError(ToolError):
    code = "REPEATED_CALL"
    raised_when = (
        "the same call (name and arguments) came in 3 consecutive rounds: valid, but not run again"
    )


class ToolNotRunError(ToolError):
    code = "NOT_RUN"
    raised_when = (
        "the session ended (cancelled, a limit, a failed step) before this call ran, or a "
        "cancel stopped it while it ran: the transcript still answers every call"
    )


# The model call -----------------------------------------------------------------------------


class ProviderError(CchatqError):
    code = "provider_error"
    raised_when = "the backend answered a 4xx other than 408/409/429, or is not configured"

    def __init__(self, message: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ProviderRetryableError(ProviderError):
    code = "provider_unavailable"
    raised_when = "429/5xx/408/409/529 or timeouts still failed after the backend's retries"

    def __init__(
        self, message: str = "", status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, status)
        self.retry_after_s = retry_after_s


class ProviderRateLimitedError(ProviderRetryableError):
    """A 429 under adaptive rate control: never retried in the call (its round waits for room
    without its worker thread, its attempts unspent); `signal` is what the headers said (a
    worker.codecs.rate_headers.RateSignal: this tree imports nothing of the codecs)."""

    raised_when = "a 429 under adaptive rate control (never a body: its round waits for room)"

    def __init__(self, message: str, retry_after_s: float | None, signal: object = None) -> None:
        super().__init__(message, 429, retry_after_s)
        self.signal = signal


class ProviderRequestError(ProviderError):
    code = "provider_error"


class ProviderProtocolError(ProviderError):
    code = "provider_protocol_error"
    raised_when = "the backend's reply could not be read (not JSON, wrong shape, bad stream)"


class ProviderTimeoutError(ProviderError):
    code = "provider_timeout"
    raised_when = (
        "the model request passed its own bound (a program chat's timeout_ms, a session's "
        "limits.request_timeout_ms) before the backend answered"
    )


# Guests, the store --------------------------------------------------------------------------


class GuestError(CchatqError):
    code = "guest_error"
    raised_when = "a WASM module could not compile, link or start (no _start, bad import)"


class GuestTrapError(GuestError):
    code = "guest_trap"
    raised_when = "an agent program trapped (unreachable, out-of-bounds access, ...)"


class StoreError(CchatqError):
    code = "store_error"
    raised_when = "Redis failed; never in a body: the step is retried"


class SpecMissingError(StoreError):
    """A session's spec is not in the store (expired, or never submitted)."""


class StoreUnavailableError(StoreError):
    """Redis refuses writes for now, through no fault of the step: `reason` is Redis's own
    word for it: OOM (used memory over maxmemory, noeviction), MISCONF (it cannot persist: a
    full disk for its AOF or RDB), READONLY (a replica, after a failover), LOADING (a restart
    reading its data). A step that meets it waits in its worker and runs again, no try spent
    (worker/session/guard.py); loops (the reconciler, lease and slot keepers) try again."""

    REASONS = ("OOM", "MISCONF", "READONLY", "LOADING")

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or f"Redis refuses writes: {reason}")
        self.reason = reason


class StoreUnreachableError(StoreError):
    """Redis did not answer: the connection failed or timed out (a cut network, a restart, a
    paused or failed-over primary). A step fails on it as on any StoreError (a try spent),
    except the write of a model's reply, which is tried again in place (its call is not made
    twice: worker/session/refusals.py `keep_writing`)."""


class BrokerUnconfirmedError(StoreError):
    """RabbitMQ did not confirm a step's messages (worker/edges/broker_amqp.py): its
    connection failed or the confirm did not come in time, it nacked one, or one came back
    unrouted (no queue of that name: a publish is mandatory). The step fails as on any
    StoreError (a try spent); its message is named by queue, never by content."""


# Control flow -------------------------------------------------------------------------------


class StepControl(CchatqError):
    """Not a failure: how a step or a guest run changes course. Carries no code of its own."""


class RetryLater(StepControl):
    def __init__(self, countdown_s: float, reason: str) -> None:
        super().__init__(reason)
        self.countdown_s = countdown_s


class RateLimited(StepControl):
    def __init__(self, wait_s: float, backend: str = "", reason: str = "") -> None:
        super().__init__(f"rate limited for {wait_s:.2f} s")
        self.wait_s = wait_s
        self.backend = backend  # the backend's name (an id)
        self.reason = reason  # "429", or what had no room: window, pace, tokens, queued


class StepsInFlight(StepControl):
    """An ending that waits for steps of its session still running (a model call in flight):
    its delivery comes back in `wait_s`, no try spent, so the end counts what they did."""

    def __init__(self, wait_s: float, steps: int) -> None:
        super().__init__(f"{steps} steps of the session still run")
        self.wait_s = wait_s


class ReplyTaken(StepControl):
    """A step's commit found its round's reply stored by another delivery of the step (first
    writer wins): nothing of it was written, and its body runs again on the stored reply."""


class StepDeadLettered(StepControl):
    """A step failed for good and was dead-lettered (its sessions end with step_failed): its
    task ends as a Celery FAILURE, so Flower and the task events show it. Ids only."""


class RunAborted(StepControl):
    """A program run ends at once; `ending` is the session error it ends with."""

    def __init__(self, ending: SessionError) -> None:
        super().__init__(ending.message)
        self.ending = ending
        self.code = ending.code


class GuestFault(StepControl):
    pass


def body_codes() -> dict[str, str]:
    """Every code that can reach a body or a tool message -> when it is raised."""
    out: dict[str, str] = {}
    stack: list[type[CchatqError]] = [CchatqError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if issubclass(cls, StepControl | StoreError) or cls.raised_when.startswith("(abstract)"):
            continue
        out.setdefault(cls.code, cls.raised_when)
    return dict(sorted(out.items()))
