"""A step's commit as one script: the writes a pipeline holds, run by one EVALSHA instead of
MULTI, the writes, EXEC. The same all-or-nothing (a script runs whole, and the `#!lua` shebang
makes a Redis that refuses writes refuse all of it before it runs), one command fewer a step
on Redis, and one reply for redis-py to parse instead of a QUEUED for each write.

Only writes whose key is their first argument ride it (SCRIPTABLE): every key is declared, so a
cluster node runs it as it ran the transaction. A commit holding anything else (the ending's
own scripts: a script cannot call another) is sent as the transaction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ARGV: the claim's value ("" for none) and TTL, then for each key in turn, how many arguments
# follow its command, the command, then those arguments (the key itself is KEYS[k]). A claim (a
# round's reply, first writer wins) is KEYS[1], set first: when another writer's value is there,
# nothing is written and that value is returned.
APPLY = """#!lua
local a, first = 3, 1
if ARGV[1] ~= '' then
  local earlier = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2], 'GET')
  if earlier and earlier ~= ARGV[1] then return earlier end
  first = 2
end
for k = first, #KEYS do
  local n = tonumber(ARGV[a])
  redis.call(ARGV[a + 1], KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  a = a + 2 + n
end
return #KEYS
"""


@dataclass(frozen=True)
class Claim:
    """A write that the rest of a commit follows only if it wins: SET NX of `value`, unless
    another writer's value is there."""

    key: str
    value: bytes
    ttl_s: int


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


def run_commit(pipe: Any, apply: Any, client: Any, claim: Claim | None = None) -> bytes | None:
    """Send what `pipe` (a pipeline without a transaction, on `client`) holds: one APPLY
    (`apply`: it registered on the store's client) when it holds two writes or more that can
    ride it (or a `claim` and writes that can), else as one MULTI/EXEC (a single write needs
    none), after the claim's own SET. The value another writer claimed first (nothing of the
    commit written), else None."""
    if len(pipe) > 1 or (claim is not None and len(pipe)):
        script_keys, args = script_form(pipe.command_stack)
        if script_keys:
            head = ([claim.key], [claim.value, claim.ttl_s]) if claim else ([], ["", 0])
            earlier = apply(keys=[*head[0], *script_keys], args=[*head[1], *args], client=client)
            pipe.reset()
            return earlier if isinstance(earlier, bytes) else None
    if claim is not None:
        earlier = client.set(claim.key, claim.value, nx=True, ex=claim.ttl_s, get=True)
        if earlier is not None and earlier != claim.value:
            pipe.reset()
            return bytes(earlier)
    if len(pipe) > 1:
        pipe.transaction = True
    pipe.execute()
    return None
