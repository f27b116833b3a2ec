"""compose.yaml is honest: every service's `command` runs, and answers, on this machine.

There is no Docker engine here, so each service's exec-form `command` is started as a plain
subprocess with the service's compose environment. Compose host names and ports become
127.0.0.1 and free ports, and services start in compose's `depends_on` order. Each service
must answer within 30 s: Redis to PING, the replay server and Flower over HTTP, and each
worker to a Celery control ping sent to its own node name while it consumes its own queue.
Healthcheck commands run the same way, because `service_healthy` waits on them. Processes
are stopped by pid: SIGTERM to the process group, then SIGKILL after 10 s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pytest
import redis
import requests
import yaml
from celery import Celery

pytestmark = pytest.mark.fleet

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
WORKER_QUEUES = {
    "worker-llm": "llm",
    "worker-tools": "tools",
    "worker-control": "control",
    "worker-programs": "programs",
    "worker-background": "background",
}
PYTHON_SERVICES = {"replay", "flower", *WORKER_QUEUES}
WAIT_S = 30.0  # per service
STOP_GRACE_S = 10.0
LOCAL = "127.0.0.1"
HOST_FLAGS = {"--host", "--address", "--bind"}
PORT_FLAGS = {"--port", "-p"}
LOCAL_NAMES = {"127.0.0.1", "localhost", "0.0.0.0"}
# Only here, never in a container: Redis listens on loopback, and its working directory is ours.
EXTRA_ARGS = {"redis": ["--bind", LOCAL]}
HEALTHCHECKED = sorted(name for name, spec in SERVICES.items() if "healthcheck" in spec)


def command_port(command: list[str]) -> int | None:
    for flag, value in itertools.pairwise(command):
        if flag == "--port":
            return int(value)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL, 0))
        return int(sock.getsockname()[1])


def dependencies(service: str) -> dict[str, str]:
    """`depends_on` as {service: condition}, in either of compose's two forms."""
    raw = SERVICES[service].get("depends_on") or {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: spec.get("condition", "service_started") for name, spec in raw.items()}


def start_order() -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
        if name not in order:
            for dep in dependencies(name):
                visit(dep, (*path, name))
            order.append(name)

    for name in SERVICES:
        visit(name, ())
    return order


def depth(service: str) -> int:
    return 1 + max((depth(dep) for dep in dependencies(service)), default=0)


def executable(name: str) -> str:
    """The program a command names, from the Python environment running these tests first."""
    if name in {"python", "python3"}:
        return sys.executable
    sibling = Path(sys.executable).with_name(name)
    if sibling.exists():
        return str(sibling)
    found = shutil.which(name)
    assert found, f"{name} is not installed here (`make install` installs it)"
    return found


@dataclass
class Plan:
    """Compose's addresses mapped to this machine: service host names and 0.0.0.0 become
    127.0.0.1, each listening service's compose port a free port here."""

    compose_ports: dict[str, int]
    local_ports: dict[str, int]
    workdir: Path

    @classmethod
    def make(cls, workdir: Path) -> Plan:
        ports = {name: command_port(spec["command"]) for name, spec in SERVICES.items()}
        compose_ports = {name: port for name, port in ports.items() if port is not None}
        return cls(compose_ports, {name: free_port() for name in compose_ports}, workdir)

    def url(self, value: str, own: str) -> str:
        parts = urlsplit(value)
        target = own if parts.hostname in LOCAL_NAMES else str(parts.hostname)
        assert target in self.compose_ports, f"{own}: {value} names no service that listens"
        assert parts.port == self.compose_ports[target], (
            f"{own}: {value} but {target} listens on port {self.compose_ports[target]}"
        )
        return parts._replace(netloc=f"{LOCAL}:{self.local_ports[target]}").geturl()

    def args(self, args: list[str], own: str) -> list[str]:
        out = [executable(args[0])]
        for prev, arg in itertools.pairwise(args):
            if prev in PORT_FLAGS:
                assert own in self.compose_ports and int(arg) == self.compose_ports[own], (
                    f"{own}: {prev} {arg} is not the port its command listens on"
                )
                out.append(str(self.local_ports[own]))
            elif prev in HOST_FLAGS:
                out.append(LOCAL)
            elif "://" in arg:
                out.append(self.url(arg, own))
            else:
                out.append(arg)
        return out

    def command(self, service: str) -> list[str]:
        return self.args(SERVICES[service]["command"], service) + EXTRA_ARGS.get(service, [])

    def env(self, service: str) -> dict[str, str]:
        # Only compose's settings: none of this machine's REDIS_URL or CCHATQ_* leak in.
        env = {
            k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("CCHATQ_")
        }
        raw = SERVICES[service].get("environment") or {}
        assert isinstance(raw, dict), f"{service}: environment as a mapping, please"
        for key, value in raw.items():
            text = str(value)
            env[key] = self.url(text, service) if "://" in text else text
        env["CCHATQ_MODULE_CACHE_DIR"] = str(self.workdir / "modules")
        return env

    def http(self, service: str, path: str) -> str:
        return f"http://{LOCAL}:{self.local_ports[service]}{path}"


@dataclass
class Stack:
    plan: Plan
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)  # seconds from start to answer
    started: dict[str, float] = field(default_factory=dict)
    app: Celery | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://{LOCAL}:{self.plan.local_ports['redis']}/0"

    def celery(self) -> Celery:
        if self.app is None:
            self.app = Celery("compose-test", broker=self.redis_url)
        return self.app

    def start(self, service: str) -> None:
        log = open(self.workdir / f"{service}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.logs[service] = log
        cwd = ROOT if SERVICES[service].get("working_dir") == "/app" else self.workdir
        self.started[service] = time.monotonic()
        self.procs[service] = subprocess.Popen(
            self.plan.command(service),
            cwd=cwd,
            env=self.plan.env(service),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def tail(self, service: str, lines: int = 40) -> str:
        path = self.workdir / f"{service}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, service: str) -> None:
        """Until the service answers its check; at most WAIT_S, failing with its log."""
        if service in self.answered:
            return
        check, what = CHECKS[service]
        proc = self.procs[service]
        deadline = time.monotonic() + WAIT_S
        while not check(self, service):
            if proc.poll() is not None:
                pytest.fail(f"{service} exited with {proc.returncode}:\n{self.tail(service)}")
            if time.monotonic() > deadline:
                log = self.tail(service)
                pytest.fail(f"{service}: no {what(service)} within {WAIT_S:.0f} s; its log:\n{log}")
            time.sleep(0.2)
        self.answered[service] = time.monotonic() - self.started[service]

    def stop(self) -> None:
        """Dependents first, each level in parallel: SIGTERM its groups, SIGKILL after 10 s."""
        if self.app is not None:
            self.app.close()
        for level in sorted({depth(name) for name in self.procs}, reverse=True):
            procs = [p for name, p in self.procs.items() if depth(name) == level]
            for proc in procs:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in procs:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(timeout=STOP_GRACE_S)
        for log in self.logs.values():
            log.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # its own session: the group is the process and its children


# checks: one try each, True once the service answers ------------------------------------


def redis_answers(stack: Stack, service: str) -> bool:
    port = stack.plan.local_ports[service]
    try:
        with redis.Redis(
            host=LOCAL, port=port, socket_connect_timeout=0.5, socket_timeout=1
        ) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def http_answers(path: str, body: str) -> Callable[[Stack, str], bool]:
    def check(stack: Stack, service: str) -> bool:
        try:
            response = requests.get(stack.plan.http(service, path), timeout=1)
        except requests.RequestException:
            return False
        return response.status_code == 200 and response.text.strip() == body

    return check


def node_name(service: str) -> str:
    """The worker's Celery node name: `cchatq worker` names it `<queue>@<hostname>`."""
    return f"{WORKER_QUEUES[service]}@{socket.gethostname()}"


def worker_answers(stack: Stack, service: str) -> bool:
    node = node_name(service)
    replies = stack.celery().control.ping(destination=[node], timeout=1.0)
    return any(node in reply for reply in replies)


# service -> (check, what it waits for)
CHECKS: dict[str, tuple[Callable[[Stack, str], bool], Callable[[str], str]]] = {
    "redis": (redis_answers, lambda _: "PONG"),
    "replay": (http_answers("/healthz", "ok"), lambda _: "200 ok from GET /healthz"),
    "flower": (http_answers("/healthcheck", "OK"), lambda _: "200 OK from GET /healthcheck"),
    **dict.fromkeys(
        WORKER_QUEUES,
        (worker_answers, lambda name: f"control-ping reply from node {node_name(name)}"),
    ),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Every service started in compose's order, each after the dependencies it waits for."""
    workdir = tmp_path_factory.mktemp("compose")
    running = Stack(Plan.make(workdir), workdir)
    try:
        for service in start_order():
            for dep, condition in dependencies(service).items():
                if condition == "service_healthy":
                    running.wait(dep)
            running.start(service)
        yield running
    finally:
        running.stop()


# the file itself ---------------------------------------------------------------------------


def test_compose_lists_the_fleet() -> None:
    assert set(SERVICES) == set(CHECKS), "a service without a check here, or a check without one"
    assert str(SERVICES["redis"]["image"]).startswith("redis:7")
    for name, spec in SERVICES.items():
        command = spec.get("command")
        assert isinstance(command, list) and all(isinstance(a, str) for a in command), (
            f"{name}: command in exec (list) form, so it is exactly what runs"
        )
    images = {
        (SERVICES[name]["image"], repr(SERVICES[name].get("build"))) for name in PYTHON_SERVICES
    }
    assert len(images) == 1, f"the Python services share one image: {images}"
    assert all(SERVICES[name].get("working_dir") == "/app" for name in PYTHON_SERVICES)
    assert "WORKDIR /app" in SERVICES["replay"]["build"]["dockerfile_inline"]


def test_addresses_name_services_on_the_ports_they_listen_on(tmp_path: Path) -> None:
    plan = Plan.make(tmp_path)
    for name in SERVICES:
        plan.env(name)  # asserts each URL names a listening service on its command's port
        plan.command(name)
    python_env = SERVICES["worker-llm"]["environment"]
    assert urlsplit(python_env["REDIS_URL"]).hostname == "redis"
    assert urlsplit(python_env["CCHATQ_REPLAY_URL"]).hostname == "replay"
    assert urlsplit(python_env["CCHATQ_REPLAY_URL"]).path == "/v1"
    published = [str(p).rsplit(":", 1)[-1] for p in SERVICES["flower"].get("ports", [])]
    assert str(plan.compose_ports["flower"]) in published, "Flower's port is published"


def test_depends_on_names_services_that_can_become_healthy() -> None:
    for name in SERVICES:
        for dep, condition in dependencies(name).items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits for {dep} to be healthy"
    assert start_order()  # and no cycle


# the services, running ---------------------------------------------------------------------


def test_redis_answers(stack: Stack) -> None:
    stack.wait("redis")


def test_replay_answers(stack: Stack) -> None:
    stack.wait("replay")


@pytest.mark.parametrize("service", sorted(WORKER_QUEUES))
def test_worker_answers_on_its_queue(stack: Stack, service: str) -> None:
    stack.wait(service)
    node = node_name(service)
    queues = stack.celery().control.inspect(destination=[node], timeout=2.0).active_queues() or {}
    assert [q["name"] for q in queues.get(node, [])] == [WORKER_QUEUES[service]], queues


def test_flower_answers(stack: Stack) -> None:
    stack.wait("flower")


def test_flower_lists_the_workers(stack: Stack) -> None:
    """Flower reads the same broker as the workers: its workers page names every node."""
    stack.wait("flower")
    for service in WORKER_QUEUES:
        stack.wait(service)
    nodes = {node_name(service) for service in WORKER_QUEUES}
    deadline = time.monotonic() + WAIT_S
    while True:
        page = requests.get(stack.plan.http("flower", "/workers"), timeout=5)
        missing = {node for node in nodes if node not in page.text}
        if page.status_code == 200 and not missing:
            return
        if time.monotonic() > deadline:
            log = stack.tail("flower")
            pytest.fail(f"Flower's /workers ({page.status_code}) lacks {sorted(missing)}:\n{log}")
        time.sleep(0.5)


@pytest.mark.parametrize("service", HEALTHCHECKED)
def test_healthcheck_passes(stack: Stack, service: str) -> None:
    stack.wait(service)
    test = SERVICES[service]["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] == "CMD", f"{service}: healthcheck in CMD form"
    done = subprocess.run(
        stack.plan.args(test[1:], service),
        cwd=ROOT,
        env=stack.plan.env(service),
        capture_output=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
