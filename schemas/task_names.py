"""Task names and queues: the contract between producer and worker (work is sent by name)."""

from __future__ import annotations

START = "cchatq.start"
ROUND = "cchatq.round"
TOOL = "cchatq.tool"
BACKGROUND_TOOL = "cchatq.background_tool"  # a `background` tool's call, up to hours
FINISH = "cchatq.finish"
PROGRAM = "cchatq.program"
NUDGE = "cchatq.nudge"

# A message header: when the message was sent (ms since the epoch), or for a retry put off by a
# countdown, when it falls due; a step's `queue_ms` is how long it then waited for a worker.
# Passed as send_task(headers=...) passes a header, so Flower and `celery inspect` see it too.
SENT_HEADER = "cchatq_sent_ms"
# A message header of a step put off through RabbitMQ's delay queues (quorum queues: worker/
# edges/amqp_topology.py): when it falls due (ms since the epoch, Redis's clock). A delivery
# that comes before it (a hop of a long put-off) is put off again for what is left.
DUE_HEADER = "cchatq_due_ms"

QUEUE_LLM = "llm"
QUEUE_TOOLS = "tools"
QUEUE_CONTROL = "control"
QUEUE_PROGRAMS = "programs"
QUEUE_BACKGROUND = "background"
ALL_QUEUES = (QUEUE_LLM, QUEUE_TOOLS, QUEUE_CONTROL, QUEUE_PROGRAMS, QUEUE_BACKGROUND)

ROUTES: dict[str, str] = {
    START: QUEUE_CONTROL,
    ROUND: QUEUE_LLM,
    TOOL: QUEUE_TOOLS,
    BACKGROUND_TOOL: QUEUE_BACKGROUND,
    FINISH: QUEUE_CONTROL,
    PROGRAM: QUEUE_PROGRAMS,
    NUDGE: QUEUE_CONTROL,
}
