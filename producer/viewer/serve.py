"""`cchatq view`'s body: choose the source (results files, else the fleet at REDIS_URL), check
the token rule, and serve the app with uvicorn until Ctrl-C. Once it listens it says where on
stderr (`cchatq view: http://HOST:PORT/`), a line the tests wait for."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import uvicorn

from producer.cli_common import (
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNREACHABLE,
    RedisUnreachable,
    reach_redis,
    redis_url,
)
from producer.client import Client
from producer.viewer.app import create_app
from producer.viewer.auth import LOOPBACK_NAMES, is_loopback
from producer.viewer.file_source import FileSource, ResultsFileError
from producer.viewer.fleet_source import FleetSource
from producer.viewer.source import ViewSource
from schemas.fleet_config import FleetConfig


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


class _Server(uvicorn.Server):
    """uvicorn's server, saying where it listens once it does."""

    def __init__(self, config: uvicorn.Config, host: str, stream: TextIO) -> None:
        super().__init__(config)
        self.shown_host = host
        self.stream = stream

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.should_exit or not self.servers:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"cchatq view: {url_of(self.shown_host, port)}", file=self.stream, flush=True)


def open_source(files: Sequence[str]) -> ViewSource:
    """Results files when named (no Redis), else the fleet at REDIS_URL. The viewer submits
    nothing, so its client holds the built-in configuration: no backend, no key of the fleet's."""
    if files:
        return FileSource([Path(f) for f in files])
    url = redis_url()
    reach_redis(url)  # a RedisUnreachable: the one line `cchatq` prints
    return FleetSource(Client(url, config=FleetConfig()), url)


def run_viewer(
    files: Sequence[str],
    host: str,
    port: int,
    token: str | None,
    stream: TextIO | None = None,
) -> int:
    stream = stream or sys.stderr
    if not is_loopback(host) and not token:
        print(
            f"cchatq view: --host {host} is not a loopback address: it needs --token T "
            "(or CCHATQ_VIEW_TOKEN)",
            file=stream,
        )
        return EXIT_REJECTED
    try:
        source = open_source(files)
    except ResultsFileError as exc:
        print(f"cchatq view: {exc}", file=stream)
        return EXIT_REJECTED
    except RedisUnreachable as exc:
        print(exc, file=stream)
        return EXIT_UNREACHABLE
    # without a token, only a loopback Host is served (no page of another site may rebind to it)
    hosts = None if token else {*LOOPBACK_NAMES, host}
    app = create_app(source, token=token, hosts=hosts)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on"
    )
    _Server(config, host, stream).run()
    return EXIT_OK
