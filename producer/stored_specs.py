"""The compact form a validated spec is kept in until it is enqueued: the bytes Redis will
hold for it (its stored form, modules named by their sha256), their digest, its id and line,
and the little the submit needs besides (the queues it runs on, whether it may take a second
round, the module files to upload). `cchatq submit` keeps one of these per line instead of the
spec's objects (about 0.4 KB a line instead of 1 KB, the stored form deflated: see `body`),
and the bytes the spec was validated as are the bytes enqueued.

A module is hashed when its spec is made compact (each file once) and uploaded at enqueue
under that hash unless Redis holds it already (the bytes that were checked); a file uploaded
that changed in between is refused there (ModuleChangedError), with nothing enqueued.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from schemas import keys
from schemas.bodies import dump_body
from schemas.spec_types import (
    ProgramSpec,
    SessionSpec,
    Spec,
    spec_from_json,
    spec_to_json,
    stored,
)
from schemas.task_names import (
    ALL_QUEUES,
    QUEUE_BACKGROUND,
    QUEUE_CONTROL,
    QUEUE_LLM,
    QUEUE_PROGRAMS,
    QUEUE_TOOLS,
)

T = TypeVar("T")
WBITS = -15  # raw deflate: no header or checksum (the content digest checks the bytes)
# (sha256, the file to upload it from; "" when it was read back from Redis, where it must be)
Module = tuple[str, str]


@dataclass(frozen=True, slots=True)
class StoredSpec:
    id: str
    packed: bytes  # its stored form (what keys.spec holds, before keys.with_submitted), packed
    dictionary: bytes  # what it was packed against (shared between specs): see `body`
    content: str  # keys.content_digest(body): what an id's claim compares
    size: int  # len(body): what its keys will take in Redis (producer/redis_room.py)
    queues: frozenset[str]  # the queues its steps run on (shared between specs)
    tools: bool  # may run a second round (tools or MCP servers; a program run)
    program: bool
    modules: tuple[Module, ...] = ()  # shared between specs naming the same modules
    line: int = 0  # in its spec file (0: not from a file)

    @property
    def body(self) -> bytes:
        """The stored form. Kept deflated against the first spec of its file (the specs of a
        batch share most of their bytes: flags, limits and tools spelled out in full), a
        500-byte body is held in about 25."""
        if not self.dictionary:
            return self.packed
        unpack = zlib.decompressobj(WBITS, zdict=self.dictionary)
        return unpack.decompress(self.packed) + unpack.flush()

    def spec(self) -> Spec:
        """The spec as the workers read it (modules by sha256)."""
        return spec_from_json(json.loads(self.body))


class ModuleChangedError(Exception):
    """A module file changed between its spec's validation and its upload."""

    def __init__(self, path: str) -> None:
        super().__init__(f"module {path} changed since its spec was checked: submit again")
        self.path = path


def spec_queues(spec: Spec) -> frozenset[str]:
    """The queues a spec's steps run on, the start's included (each must have a worker)."""
    if isinstance(spec, ProgramSpec):
        return frozenset((QUEUE_CONTROL, QUEUE_PROGRAMS, QUEUE_LLM))  # its chats' rounds too
    needed = {QUEUE_CONTROL, QUEUE_LLM}
    if spec.tools:
        needed.add(QUEUE_TOOLS)
    if any(t.policy.background for t in spec.tools):
        needed.add(QUEUE_BACKGROUND)
    return frozenset(needed)


def needed_queues(specs: Sequence[Spec | StoredSpec]) -> list[str]:
    """The queues these sessions' steps will run on, in ALL_QUEUES' order."""
    needed = {QUEUE_CONTROL}
    for spec in specs:
        needed |= spec.queues if isinstance(spec, StoredSpec) else spec_queues(spec)
    return [q for q in ALL_QUEUES if q in needed]


def file_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Compactor:
    """Makes specs compact; each module file hashed once, equal parts shared."""

    def __init__(self) -> None:
        self._shas: dict[str, str] = {}  # module path -> its sha256
        self._shared: dict[object, object] = {}  # one object for equal queue sets, modules
        self._dictionary: bytes | None = None

    def __call__(self, spec: Spec | StoredSpec, line: int = 0) -> StoredSpec:
        """`spec`'s compact form (one compact already: itself)."""
        if isinstance(spec, StoredSpec):
            return spec
        named = [spec.program] if isinstance(spec, ProgramSpec) else list(spec.tools)
        modules: list[Module] = []
        for module in named:
            if module.module_sha256:  # read back from Redis
                modules.append((module.module_sha256, ""))
            else:
                if module.module not in self._shas:
                    self._shas[module.module] = file_sha256(module.module)
                modules.append((self._shas[module.module], module.module))
        body = dump_body(spec_to_json(stored(spec, self._shas) if named else spec))
        tools = not isinstance(spec, SessionSpec) or bool(spec.tools or spec.mcp_servers)
        if self._dictionary is None:
            self._dictionary = body  # the first: the others are packed against it
        pack = zlib.compressobj(1, zlib.DEFLATED, WBITS, zdict=self._dictionary)
        return StoredSpec(
            id=spec.id,
            packed=pack.compress(body) + pack.flush(),
            dictionary=self._dictionary,
            content=keys.content_digest(body),
            size=len(body),
            queues=self._share(spec_queues(spec)),
            tools=tools,
            program=isinstance(spec, ProgramSpec),
            modules=self._share(tuple(dict.fromkeys(modules))),
            line=line,
        )

    def _share(self, value: T) -> T:
        return self._shared.setdefault(value, value)  # type: ignore[return-value]


def compact(specs: Sequence[Spec | StoredSpec]) -> list[StoredSpec]:
    """Specs made compact (those compact already kept as they are)."""
    compactor = Compactor()
    return [compactor(spec) for spec in specs]


def module_uploads(specs: Sequence[StoredSpec]) -> tuple[list[tuple[str, str]], list[str]]:
    """(sha256, path) of each module file to upload, and the sha256 of each module that must
    be in Redis already: each once, sorted."""
    found = {m for spec in specs for m in spec.modules}
    files = sorted((sha, path) for sha, path in found if path)
    hashed = sorted({sha for sha, path in found if not path})
    return files, hashed
