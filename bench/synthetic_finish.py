"""Finishing a submitted batch's sessions without a fleet: each session's ending written by the
workers' own write-once script (worker/edges/store_results.py: the record, the response fd,
the meta's end) and the batches watching it told as a worker's ending step tells them (done
list and ended index). For timing what reads a big finished batch (`cchatq batch status`, the
viewer) where a real fleet would take hours on 2 cores; the records are plain one-round
answers, and the sessions are not retired (their metas stay), which no reader here needs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from producer.redis_connect import is_cluster
from schemas import keys
from schemas.bodies import dump_body
from worker.edges.store_results import WRITE_ONCE

PART = 1000  # sessions a round trip


def answer(spec_id: str, n: int, error: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(body, record) of a one-round session, as the workers' ending makes them."""
    if error:
        body: dict[str, Any] = {
            "error": {"code": "provider_error", "message": "HTTP 400: bad request"}
        }
    else:
        body = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "model": "replay/plain",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": f"Hello, session {n}!"},
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
        }
    record = {
        "id": spec_id,
        "status": "error" if error else "ok",
        "body": body,
        "transcript": [
            {"role": "user", "content": f"Say hello to session {n}"},
            *([] if error else [body["choices"][0]["message"]]),
        ],
        "metrics": {
            "iterations": 0 if error else 1,
            "latency_ms": 200 + n % 700,
            "tool_calls": 0,
            "tool_failures": 0,
            "tool_output_bytes": 0,
            "usage": {} if error else dict(body["usage"]),
        },
    }
    return body, record


def finish_sessions(
    client: Any, batch: str, error_every: int = 50, ttl_s: int = 86_400, most: int | None = None
) -> int:
    """End the first `most` (None: every) session of `batch` that has not ended, one in
    `error_every` with a provider error: how many were ended."""
    write_once = client.register_script(WRITE_ONCE)
    cluster = is_cluster(client)
    runs: Sequence[bytes] = client.lrange(keys.batch_runs(batch), 0, -1)
    ids: Sequence[bytes] = client.lrange(keys.batch_ids(batch), 0, -1)
    members = list(zip(ids, runs, strict=True))[:most]
    ended = 0
    for start in range(0, len(members), PART):
        part = members[start : start + PART]
        pipe = client.pipeline(transaction=False)
        now_ms = int(time.time() * 1000)
        written: list[Any] = []
        for n, (raw_id, raw_run) in enumerate(part, start=start):
            sk = keys.Claim.decode(raw_run).sk
            body, record = answer(raw_id.decode(), n, error=n % error_every == error_every - 1)
            code = body["error"]["code"] if "error" in body else "ok"
            own = [keys.record(sk), keys.response(sk), keys.meta(sk), keys.watchers(sk)]
            # on a cluster the index is in another slot (left after the script, as the workers
            # do), and a script runs alone: a cluster's pipelines take none
            found = write_once(
                keys=own if cluster else [*own, keys.ACTIVE],
                args=[dump_body(record), json.dumps(body), ttl_s, now_ms, code,
                      keys.round_step(sk, 0), sk, batch],
                client=client if cluster else pipe,
            )  # fmt: skip
            if cluster:
                written.append(found)
        written = written if cluster else pipe.execute()
        notify = client.pipeline(transaction=False)
        for (_, raw_run), (code, watchers, *_) in zip(part, written, strict=True):
            if not code:
                continue
            ended += 1
            sk = keys.Claim.decode(raw_run).sk
            if cluster:
                notify.zrem(keys.ACTIVE, sk)
            for watcher in dict.fromkeys(watchers):  # what the ending's commit adds (add_notify)
                batch_name = watcher.decode()
                notify.rpush(keys.done_list(batch_name), sk)
                notify.expire(keys.done_list(batch_name), ttl_s)
                notify.hset(keys.batch_ended(batch_name), sk, f"{code.decode()} {now_ms}")
                notify.expire(keys.batch_ended(batch_name), ttl_s)
        notify.execute()
    return ended
