"""Long tool results summed up by a model (`limits.compress: "summarize"`):
the tool step asks the session's backend (or `compress_backend`, with `compress_model`) for a
summary of an output over `compress_over_bytes`, and stores it with the outcome, so the model
reads the summary and the store keeps the output whole. No summary (no backend, no room under
its rate limit, a failed call, an empty answer) leaves the excerpt."""

from __future__ import annotations

import logging
from dataclasses import replace

from schemas.spec_types import SessionSpec
from worker.codecs.protocol import ChatRequest
from worker.codecs.reply import Reply
from worker.errors import ProviderError, RateLimited
from worker.session.engine import ToolRun
from worker.session.model_call import ModelCaller
from worker.session.outcomes import ToolOutcome, excerpt

log = logging.getLogger(__name__)
SUMMARY_INPUT_BYTES = 200_000  # the most of an output sent to be summed up (an excerpt beyond)
PROMPT = (
    "You sum up the output of the tool `{tool}` for the assistant that called it. Keep every "
    "fact, number, name and error it may need; drop repetition and markup. Answer with the "
    "summary only, in at most {words} words."
)


def summarized(
    models: ModelCaller, spec: SessionSpec, run: ToolRun, outcome: ToolOutcome
) -> ToolOutcome:
    limits = spec.limits
    output = outcome.output or ""
    if (
        limits.compress != "summarize"
        or not outcome.ok
        or outcome.output_bytes <= limits.compress_over_bytes
    ):
        return outcome
    route = models.route(
        limits.compress_backend or spec.provider, limits.compress_model or spec.model
    )
    backend = models.backend(route.backend)
    if backend is None:
        return outcome
    text = (
        output
        if len(output.encode()) <= SUMMARY_INPUT_BYTES
        else excerpt(output, SUMMARY_INPUT_BYTES)
    )
    chat = ChatRequest(
        model=route.model,
        messages=[
            {
                "role": "system",
                "content": PROMPT.format(tool=run.name, words=limits.compress_over_bytes // 8),
            },
            {"role": "user", "content": text},
        ],
        tools=[],
        params=route.params,
    )
    try:
        reply = Reply.parse(models.complete(backend, chat))
    except RateLimited:
        return outcome  # no room now: the excerpt will do
    except ProviderError as exc:
        log.info("summary of call %s failed: %s", run.call_id, exc.code)
        return outcome
    summary = reply.content
    if summary is None or not summary.strip():
        return outcome
    return replace(outcome, summary=summary.strip())
