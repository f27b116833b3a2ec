"""Task names and queues: the contract between producer and worker (work is sent by name)."""

from __future__ import annotations

START = "cchatq.start"
ROUND = "cchatq.round"
TOOL = "cchatq.tool"
FINISH = "cchatq.finish"
PROGRAM = "cchatq.program"
NUDGE = "cchatq.nudge"

QUEUE_LLM = "llm"
QUEUE_TOOLS = "tools"
QUEUE_CONTROL = "control"
QUEUE_PROGRAMS = "programs"
ALL_QUEUES = (QUEUE_LLM, QUEUE_TOOLS, QUEUE_CONTROL, QUEUE_PROGRAMS)

ROUTES: dict[str, str] = {
    START: QUEUE_CONTROL,
    ROUND: QUEUE_LLM,
    TOOL: QUEUE_TOOLS,
    FINISH: QUEUE_CONTROL,
    PROGRAM: QUEUE_PROGRAMS,
    NUDGE: QUEUE_CONTROL,
}
