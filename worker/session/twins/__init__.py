"""In-memory twins of the session's ports (as dramatiq ships its StubBroker and httpx its
MockTransport): the steps run on them exactly as on Redis and Celery, in one process. A module
per port:

- `store`: MemoryStore, the SessionStore (and the guest's ProgramStore, with `programs` and
  `streams`), under the Redis store's rules; `tests/test_store_contract.py` runs one contract
  over both. Keys never expire here. `failing`: a store that fails on cue.
- `queue`: StepQueue, the Dispatcher: it records what was published and runs it on a
  StepRunner (`drain`), turning `RetryLater` into a requeue, as Celery's retry does.
- `models`: ScriptedProvider (the CompletionProvider), OpenRateLimiter (the RateLimiter) and
  OpenRateControl (the RateControl).
- `tools`: PythonTools and NoTools (the ToolRuntime); `mcp`: MemoryMcp (the McpClient).
"""
