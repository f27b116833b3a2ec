"""In-memory twins of the session's ports (as dramatiq ships its StubBroker and httpx its
MockTransport): the steps run on them exactly as on Redis and Celery, in one process. A module
per port:

- `store`: MemoryStore, every role of the store (StepData; StepGuards in `store_guards`;
  SessionLifecycle, BatchLinks and FleetUpkeep in `store_endings`) and the guest's ProgramStore
  (with `programs` and `streams`), under the Redis store's rules; `tests/store_contract/` runs
  one contract a role over both. Keys never expire here. `failing`: a store that fails on cue.
- `queue`: StepQueue, the Dispatcher: it records what was published and runs it on a
  StepRunner (`drain`), turning `RetryLater` into a requeue, as Celery's retry does.
- `models`: ScriptedProvider (the CompletionProvider), OpenRateLimiter (the RateLimiter) and
  OpenRateControl (the RateControl).
- `tools`: PythonTools and NoTools (the ToolRuntime); `mcp`: MemoryMcp (the McpClient).
"""
