"""Is the process that holds a lease, or took a broker message, still alive? Asked only of a
process on this machine, where the answer is exact: a step lease and a broker consumer each
name their process (`<pid>@<host>`), so a worker that finds one held by a process of its own
machine that is gone (killed: a worker's main process or a pool child) takes it over at
once, instead of waiting for its TTL (a lease's 15 s, a consumer's heartbeat). A process of
another machine is taken for alive: its lease or heartbeat runs out as before.
"""

from __future__ import annotations

import os
import socket
import threading

HOST = socket.gethostname()

# the lease tokens this process handed out and whose delivery has not ended: a lease of this
# very process that is not among them was left behind (its release could not reach Redis)
_live_tokens: set[str] = set()
_lock = threading.Lock()


def this_process() -> str:
    return f"{os.getpid()}@{HOST}"


def pid_gone(pid: int) -> bool:
    """Whether process `pid` of this machine has ended (or is a zombie not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (comm) S ...": the state follows the last ')' (comm may hold one)
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def process_gone(holder: str) -> bool:
    """Whether the process `holder` (`<pid>@<host>`) is known to be gone: it ran on this
    machine and has ended. A holder of this very process is never gone by this test."""
    pid_text, _, host = holder.partition("@")
    if host != HOST or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    return pid != os.getpid() and pid_gone(pid)


def named(unique: str) -> str:
    """`<unique>.<pid>@<host>`: a name that says which process holds it (a step lease's token,
    a broker consumer)."""
    return f"{unique}.{this_process()}"


def holder_of(name: str) -> str:
    """The `<pid>@<host>` of a name `named` made ("" for a name of an older fleet)."""
    return name.partition(".")[2]


def new_token(unique: str) -> str:
    """A lease token naming this process, live until `retire` (its delivery ended)."""
    token = named(unique)
    with _lock:
        _live_tokens.add(token)
    return token


def retire(token: str) -> None:
    with _lock:
        _live_tokens.discard(token)


def token_abandoned(token: str) -> bool:
    """Whether the lease `token` names a process that cannot be holding it any more: one of
    this machine that is gone, or this process, when no delivery of it holds the token."""
    holder = holder_of(token)
    if holder == this_process():
        with _lock:
            return token not in _live_tokens
    return process_gone(holder)
