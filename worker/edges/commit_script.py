"""A step's commit as one script: the writes a pipeline holds, run by one EVALSHA instead of
MULTI, the writes, EXEC. The same all-or-nothing (a script runs whole, and the `#!lua` shebang
makes a Redis that refuses writes refuse all of it before it runs), one command fewer a step
on Redis, and one reply for redis-py to parse instead of a QUEUED for each write.

Only writes whose key is their first argument ride it (SCRIPTABLE): every key is declared, so a
cluster node runs it as it ran the transaction. A commit holding anything else (the ending's
own scripts: a script cannot call another) is sent as the transaction."""

from __future__ import annotations

from typing import Any

# ARGV: for each key in turn, how many arguments follow its command, the command, then those
# arguments (the key itself is KEYS[k])
APPLY = """#!lua
local a = 1
for k = 1, #KEYS do
  local n = tonumber(ARGV[a])
  redis.call(ARGV[a + 1], KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  a = a + 2 + n
end
return #KEYS
"""

SCRIPTABLE = frozenset(
    {"SET", "LPUSH", "RPUSH", "LREM", "XADD", "EXPIRE", "HSET", "ZADD", "ZREM", "SADD", "DEL"}
)


def script_form(stack: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """The keys and arguments of APPLY for a pipeline's `command_stack`; ([], []) when a
    command there cannot ride it. DEL rides it with one key only."""
    script_keys: list[Any] = []
    args: list[Any] = []
    for command, _ in stack:
        name = str(command[0]).upper()
        if name not in SCRIPTABLE or len(command) < 2 or (name == "DEL" and len(command) > 2):
            return [], []
        script_keys.append(command[1])
        args += [len(command) - 2, name, *command[2:]]
    return script_keys, args


def run_commit(pipe: Any, apply: Any, client: Any) -> None:
    """Send what `pipe` (a pipeline without a transaction, on `client`) holds: one APPLY
    (`apply`: it registered on the store's client) when it holds two writes or more that can
    ride it, else as one MULTI/EXEC (a single write needs none)."""
    if len(pipe) > 1:
        script_keys, args = script_form(pipe.command_stack)
        if script_keys:
            apply(keys=script_keys, args=args, client=client)
            pipe.reset()
            return
        pipe.transaction = True
    pipe.execute()
