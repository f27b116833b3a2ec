"""`python -m bench.screenshots` (or `make screenshots`): the pictures of `cchatq view` in the
docs, taken from a real run. A private fleet (Redis, the replay server, one worker per queue)
runs the demo batch and a small second batch, a third batch is left queued (no llm worker takes
it) so the runs page shows one still running, and headless chromium (Debian's, driven by
Playwright; `make chromium`) opens the runs page, the demo batch and one of its two-round
sessions at 1280x800. Each picture is the viewport, not the whole page, rewritten with a
palette of 256 colours (bench/png_palette.py), so it stays small:

  docs/images/view-runs.png  docs/images/view-batch.png  docs/images/view-session.png
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import uuid
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from bench.browser import VIEWPORT, Viewer, batch_path, launch_chromium, session_path
from bench.png_palette import palette_png
from producer.cli_programs import DEMO_FILE
from producer.client import Client
from producer.fleet import Fleet
from producer.specfile import load_spec_file
from schemas.spec_types import Spec

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"


def replace_id(spec: Spec, spec_id: str) -> Spec:
    return dataclasses.replace(spec, id=spec_id)


def _shoot(page: Page, url: str, ready: str, name: str) -> Path:
    page.goto(url)
    page.locator(ready).first.wait_for(state="visible", timeout=30_000)
    path = IMAGES / name
    page.screenshot(path=path)  # the viewport only: small files
    palette_png(path)  # and a third of that again
    return path


def shoot_pages(viewer: Viewer, batch: str, session: str) -> list[Path]:
    """The runs page, one batch and one session, each once its content is there."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    pages = [
        ("/", "table#runs tr[data-batch]", "view-runs.png"),
        (batch_path(batch), "table#sessions tr[data-session]", "view-batch.png"),
        (session_path(session), "#thread .tool-call", "view-session.png"),
    ]
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            return [_shoot(page, viewer.url + path, ready, name) for path, ready, name in pages]
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=48, help="demo sessions (default 48)")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:6]
    loaded = [s.spec for s in load_spec_file(DEMO_FILE)]
    demo = [replace_id(s, f"{run}:{s.id}") for s in loaded[: args.limit]]
    plain = [s for s in loaded if s.id.startswith("demo/plain/")]
    two_rounds = next(s.id for s in demo if "/two_rounds/" in s.id)
    with Fleet() as fleet:
        redis_url = fleet.ensure_redis(private=True)
        fleet.start_replay()
        fleet.start_workers()
        fleet.wait_served()
        client = Client(redis_url, config=fleet.config())
        try:
            # loaded specs, validated already (their modules resolved): enqueued as they are
            quick = client.enqueue([replace_id(s, f"{run}:quick:{s.id}") for s in plain[:6]])
            list(client.wait(quick, timeout_s=120))
            shown = client.enqueue(demo)
            list(client.wait(shown, timeout_s=300))
            # a batch still under way: no llm worker takes its sessions, so it stays running
            for name in [n for n in fleet.workers if n.startswith("llm")]:
                fleet.kill(fleet.workers.pop(name), signal.SIGTERM)
            client.enqueue([replace_id(s, f"{run}:pending:{s.id}") for s in plain[:8]])
        finally:
            client.close()
        env = {**os.environ, "REDIS_URL": redis_url}
        viewer = Viewer.start([], env, fleet.workdir / "viewer.log")
        try:
            written = shoot_pages(viewer, shown.batch, two_rounds)
        finally:
            viewer.stop()
    for path in written:
        print(f"{path.relative_to(ROOT)}  {path.stat().st_size // 1024} KB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
