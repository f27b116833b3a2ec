"""Gathering a run's history (bench/history.py) from where it lives, through the producer's own
readers: each submitted id's run by its claim (Client.claims) and each member of the batches
submitted since the run began (Batches), their records (Client.records) and trace events
(Client.run_trace), and the replay server's request log (GET /log) from the entry the run
began at. Imports no worker code, so fleet tests use it as `make chaos` does:

    mark = mark_run(fleet.replay_url)          # before the submit
    ...submit, wait (keeping the ids of the results handed out)...
    verdict = check_run("name", client, objects, mark, delivered)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from bench.history import History, Run, StoredRecord, Submitted, Verdict, judge
from fixtures.replay.request_log import PAGE_LIMIT, LoggedRequest
from producer.batches import Batches
from producer.client import Client

MGET = 1000  # records a read asks for at once
HTTP_TIMEOUT_S = 10


@dataclass(frozen=True)
class RunMark:
    """Where a run begins, noted before its submit: the replay log's next entry (None: no
    replay server) and the time, from which its batches count."""

    replay_root: str | None
    log_since: int | None
    since_ms: int


def replay_root(url: str) -> str:
    """The replay server's root URL from its OpenAI base URL (`.../v1`) or the root itself."""
    return url.rstrip("/").removesuffix("/v1")


def mark_run(replay_url: str | None) -> RunMark:
    since = None
    root = None if replay_url is None else replay_root(replay_url)
    if root is not None:
        page = requests.get(f"{root}/log", params={"limit": 0}, timeout=HTTP_TIMEOUT_S)
        page.raise_for_status()
        since = int(page.json()["next"])
    return RunMark(root, since, int(time.time() * 1000))


def first_user_text(messages: Any) -> str:
    """The text of the first user message (its text parts joined), as the replay server reads
    it; "" when there is none."""
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            parts = content if isinstance(content, list) else []
            return "".join(
                str(p.get("text", ""))
                for p in parts
                if isinstance(p, Mapping) and p.get("type") == "text"
            )
    return ""


def submitted_of(objects: Iterable[Mapping[str, Any]]) -> tuple[Submitted, ...]:
    """The sessions of spec objects (a spec file's lines) as the history's inputs."""
    return tuple(Submitted(str(o["id"]), first_user_text(o.get("messages"))) for o in objects)


def read_log(mark: RunMark) -> tuple[tuple[LoggedRequest, ...] | None, bool]:
    """The replay log's entries since the mark, and whether it still held them all."""
    if mark.replay_root is None or mark.log_since is None:
        return None, False
    entries: list[LoggedRequest] = []
    since, complete = mark.log_since, True
    while True:
        page = requests.get(
            f"{mark.replay_root}/log",
            params={"since": since, "limit": PAGE_LIMIT},
            timeout=HTTP_TIMEOUT_S,
        )
        page.raise_for_status()
        body = page.json()
        complete = complete and int(body["first"]) <= mark.log_since
        entries.extend(LoggedRequest.from_json(e) for e in body["entries"])
        since = entries[-1].seq + 1 if entries else since
        if not body["entries"] or since >= int(body["next"]):
            return tuple(entries), complete


def read_history(
    client: Client,
    submitted: Sequence[Submitted],
    mark: RunMark,
    delivered: Sequence[str] | None = None,
    namespace: str | None = None,
    batches: Sequence[str] | None = None,
) -> History:
    """What the run left in Redis and in the replay server's log. `delivered`: the spec ids of
    the results the producer handed out, one per result (None: not watched). `batches`: the
    run's own batches (None: every batch submitted since the mark), for a run whose batches
    overlap others' (make soak's): their sessions are no ending of this run's."""
    ids = [s.spec_id for s in submitted]
    runs: dict[str, str] = {}  # sk -> the id it runs
    for spec_id, claim in zip(ids, client.claims(ids, namespace), strict=True):
        if claim is not None:
            runs[claim.sk] = spec_id
    reader = Batches(client)
    if batches is None:
        batches = [b for b, submitted_ms, _ in reader.recent() if submitted_ms >= mark.since_ms]
    for batch in batches:
        for member in reader.members(batch):
            if member.claim is not None:
                runs.setdefault(member.claim.sk, member.spec_id)
    sks = list(runs)
    records: list[dict[str, Any] | None] = []
    for start in range(0, len(sks), MGET):
        records.extend(client.records(sks[start : start + MGET]))
    found = tuple(
        Run(
            runs[sk],
            sk,
            None if record is None else StoredRecord.from_record(record),
            sum(1 for e in client.run_trace(sk) if e.get("event") == "session.finished"),
        )
        for sk, record in zip(sks, records, strict=True)
    )
    log, complete = read_log(mark)
    return History(
        tuple(submitted),
        found,
        None if delivered is None else tuple(delivered),
        log,
        complete,
    )


def check_run(
    run: str,
    client: Client,
    objects: Iterable[Mapping[str, Any]],
    mark: RunMark,
    delivered: Sequence[str] | None = None,
    namespace: str | None = None,
    batches: Sequence[str] | None = None,
) -> Verdict:
    """The verdict of the run of these spec objects, begun at `mark` (`batches`: read_history)."""
    submitted = submitted_of(objects)
    return judge(run, read_history(client, submitted, mark, delivered, namespace, batches))
