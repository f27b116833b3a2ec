"""Headless chromium and `cchatq view` as subprocesses, for the viewer's browser tests
(tests/test_view_browser.py) and the pictures in the docs (bench/screenshots.py).

The browser is Debian's chromium at /usr/bin/chromium (`make chromium`), launched by Playwright
through `executable_path`: Playwright's own browser builds are never downloaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from playwright.sync_api import Browser, Playwright, ViewportSize

from producer.fleet import free_port

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
LISTENING = "cchatq view: http://"  # the line `cchatq view` prints on stderr once it listens


def launch_chromium(pw: Playwright) -> Browser:
    """Headless chromium from the system package."""
    if not CHROMIUM.exists():
        raise RuntimeError(f"{CHROMIUM} is missing: `make chromium` installs it (apt)")
    return pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)


def session_path(spec_id: str, batch: str | None = None) -> str:
    """A session page's path: the id quoted whole (it may hold `/`), as the viewer links it;
    with `batch`, the run that batch ran (as a batch page links it)."""
    in_batch = "" if batch is None else "?batch=" + quote(batch, safe="")
    return "/session/" + quote(spec_id, safe="") + in_batch


def batch_path(batch: str) -> str:
    return "/batch/" + quote(batch, safe="")


@dataclass
class Viewer:
    """A `cchatq view` subprocess, stopped by its pid."""

    url: str  # http://127.0.0.1:PORT, no trailing slash
    proc: subprocess.Popen[bytes]
    log: Path  # its stderr (its stdout beside it, .out)

    @classmethod
    def start(
        cls, args: list[str], env: dict[str, str], log: Path, timeout_s: float = 60
    ) -> Viewer:
        """`cchatq view ARGS --port <free>`; returns once its stderr holds the
        `cchatq view: http://HOST:PORT/` line. Its output goes to files, polled, so the server
        never blocks on a pipe nobody reads."""
        port = free_port()
        cmd = [sys.executable, "-m", "producer.cli", "view", *args, "--port", str(port)]
        with open(log, "wb") as err, open(log.with_suffix(".out"), "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        viewer = cls(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + timeout_s
        while LISTENING not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                viewer.stop()
                raise RuntimeError(f"cchatq view did not start: {cmd}\n{log.read_text()}")
            time.sleep(0.05)
        line = next(x for x in log.read_text().splitlines() if LISTENING in x)
        if f"{LISTENING}127.0.0.1:{port}/" not in line:
            viewer.stop()
            raise RuntimeError(f"cchatq view announced {line!r}, not port {port}")
        return viewer

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is still there after 15 s."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
