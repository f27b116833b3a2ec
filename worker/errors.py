"""One error tree for the worker. Foreign exceptions are translated once, at their edge.

CchatqError                      root; `code` is the error-body code, `errno` the hostcall errno
├── SessionError                 ends a session with an error body (model, guest or user at fault)
│   ├── ToolCallLimitError       code tool_call_limit
│   ├── UnknownToolError         code unknown_tool (strict_unknown_tool only)
│   ├── CancelledError           code cancelled
│   └── StepFailedError          code step_failed (poison step sent to the dead-letter stream)
├── ToolError                    a tool call failed; becomes an error tool message, loop goes on
│   ├── ToolExecError            code tool_exec_failed (rc < 0, trap, timeout, bad UTF-8, too big)
│   └── ToolArgumentsError       code invalid_arguments (bad JSON or schema violation)
├── ProviderError                the model call failed
│   ├── ProviderRetryableError   429 / 5xx / 408 / 409 / timeouts: retried with backoff
│   ├── ProviderRequestError     other 4xx: ends the session (code provider_error)
│   └── ProviderProtocolError    a reply we cannot read (code provider_protocol_error)
├── StoreError                   Redis failed; the step is retried
└── GuestError                   a WASM module could not load or instantiate (code guest_error)
"""

from __future__ import annotations


class CchatqError(Exception):
    code: str = "internal_error"
    errno: int = 5  # EIO

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message or self.code


class SessionError(CchatqError):
    code = "session_error"


class ToolCallLimitError(SessionError):
    code = "tool_call_limit"


class UnknownToolError(SessionError):
    code = "unknown_tool"


class CancelledError(SessionError):
    code = "cancelled"


class StepFailedError(SessionError):
    code = "step_failed"


class ToolError(CchatqError):
    code = "tool_exec_failed"


class ToolExecError(ToolError):
    code = "tool_exec_failed"


class ToolArgumentsError(ToolError):
    code = "invalid_arguments"
    errno = 22  # EINVAL


class ProviderError(CchatqError):
    code = "provider_error"

    def __init__(self, message: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ProviderRetryableError(ProviderError):
    code = "provider_unavailable"

    def __init__(
        self, message: str = "", status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, status)
        self.retry_after_s = retry_after_s


class ProviderRequestError(ProviderError):
    code = "provider_error"


class ProviderProtocolError(ProviderError):
    code = "provider_protocol_error"


class StoreError(CchatqError):
    code = "store_error"


class GuestError(CchatqError):
    code = "guest_error"
