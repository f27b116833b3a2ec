"""Publishing the next step: the worker's only celery importer besides the app module.

Task ids are the step ids, so a step published twice is the same task in Flower, and task
arguments are ids only (no prompt or tool argument ever travels in a message).
"""

from __future__ import annotations

from celery import Celery

from schemas import keys, task_names


class Dispatcher:
    def __init__(self, app: Celery) -> None:
        self.app = app

    def _send(self, name: str, args: list[str | int], task_id: str) -> None:
        self.app.send_task(
            name, args=args, task_id=task_id, queue=task_names.ROUTES[name], argsrepr=repr(args)
        )

    def round(self, sk: str, round_no: int) -> None:
        self._send(task_names.ROUND, [sk, round_no], keys.round_step(sk, round_no))

    def tool(self, sk: str, round_no: int, index: int) -> None:
        self._send(task_names.TOOL, [sk, round_no, index], keys.tool_step(sk, round_no, index))

    def finish(self, sk: str) -> None:
        self._send(task_names.FINISH, [sk], keys.finish_step(sk))

    def program(self, sk: str) -> None:
        self._send(task_names.PROGRAM, [sk], keys.program_step(sk))
