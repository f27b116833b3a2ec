"""compose.yaml is honest: every service's `command` runs, and answers, on this machine.

There is no Docker engine here, so each service's exec-form `command` is started as a plain
subprocess with the service's compose environment, in an empty directory of its own (the
image's /app holds no source). Compose host names and ports become 127.0.0.1 and free ports,
a bind mount's container path its directory here (so CCHATQ_CONFIG names ./fixtures/config's file),
a named volume's a folder of the test's, .env's variables (Flower's basic auth) what a user
would set, and services start in compose's `depends_on` order. Each service must answer within
30 s: Redis to PING (with its AOF on), the replay server, Flower and the metrics exporter over
HTTP, and each worker to a Celery control ping sent to its own node name while it consumes its
own queue. Healthcheck commands run the same way, because `service_healthy` waits on them: a
CMD-SHELL one in `sh`, with $HOSTNAME this machine's host name and the image's PATH this
Python's scripts. Processes are stopped by pid: SIGTERM to the process group, then SIGKILL
after 10 s.

The file itself is checked against the Compose Specification's JSON schema (vendored in
tests/data), and so are the Dockerfile its build names, the .dockerignore, the mounted
configuration with the key variables .env.example documents, and the workers' stop grace
against the longest step the worker code allows.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
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

import jsonschema
import pytest
import redis
import requests
import yaml
from celery import Celery

from schemas.limits import RUN_LIMIT_BOUNDS, TOOL_TIMEOUT_CAP_MS
from worker.config import load_settings
from worker.wiring import celery_config

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
PYTHON_SERVICES = {"replay", "flower", "metrics", *WORKER_QUEUES}
WAIT_S = 30.0  # per service
STOP_GRACE_S = 10.0
LOCAL = "127.0.0.1"
HOST_FLAGS = {"--host", "--address", "--bind"}
PORT_FLAGS = {"--port", "-p"}
LOCAL_NAMES = {"127.0.0.1", "localhost", "0.0.0.0"}
# Only here, never in a container: Redis listens on loopback, and its working directory is ours.
EXTRA_ARGS = {"redis": ["--bind", LOCAL]}
HEALTHCHECKED = sorted(name for name, spec in SERVICES.items() if "healthcheck" in spec)
SCHEMA_PATH = ROOT / "tests" / "data" / "compose_spec.json"
# what tests/data/README.md says was vendored
SCHEMA_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"
DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
DURATION_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# what .env gives the Python services here (env_file): Flower's basic auth, as a user sets it
DOTENV = {"FLOWER_BASIC_AUTH": f"compose:pw{os.getpid()}"}
FLOWER_AUTH = ("compose", f"pw{os.getpid()}")


def command_flag(command: list[str], flag: str) -> str | None:
    for prev, value in itertools.pairwise(command):
        if prev == flag:
            return value
    return None


def command_port(command: list[str]) -> int | None:
    port = command_flag(command, "--port")
    return None if port is None else int(port)


def compose_literal(text: str) -> str:
    """A string of compose.yaml as a container sees it. Compose interpolates `$VAR` and
    `${VAR}` from the host's environment, so the file writes every `$` meant for a container
    as `$$`: here a lone `$` is a mistake, and `$$` is `$`."""
    lone = re.sub(r"\$\$", "", text)
    assert "$" not in lone, f"compose would interpolate the host's environment into: {text}"
    return text.replace("$$", "$")


def duration_s(value: str) -> float:
    """A compose duration ("5m", "1m30s", "300s") in seconds."""
    parts = DURATION.findall(value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * DURATION_UNITS_S[u] for n, u in parts)


def bind_mounts(service: str) -> dict[str, Path]:
    """A service's bind mounts: container path -> the directory here (short syntax)."""
    mounts: dict[str, Path] = {}
    for volume in SERVICES[service].get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (ROOT / source).resolve()
    return mounts


def named_volumes(service: str) -> dict[str, str]:
    """A service's named volumes: container path -> volume name (short syntax)."""
    mounts: dict[str, str] = {}
    for volume in SERVICES[service].get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        if not source.startswith((".", "/")):
            mounts[target] = source
    return mounts


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
                out.append(self.volume_path(arg, own))
        return out

    def volume_path(self, arg: str, own: str) -> str:
        """A path in one of the service's named volumes: that volume's folder here."""
        for target, name in named_volumes(own).items():
            if arg == target or arg.startswith(target + "/"):
                folder = self.volume(name)
                return str(folder) + arg[len(target) :]
        return arg

    def volume(self, name: str) -> Path:
        folder = self.workdir / "volumes" / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def command(self, service: str) -> list[str]:
        return self.args(SERVICES[service]["command"], service) + EXTRA_ARGS.get(service, [])

    def env(self, service: str) -> dict[str, str]:
        # Only compose's settings: none of this machine's REDIS_URL or CCHATQ_* leak in.
        env = {
            k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("CCHATQ_")
        }
        if service in PYTHON_SERVICES:  # env_file .env, as a user fills it in
            env.update(DOTENV)
        raw = SERVICES[service].get("environment") or {}
        assert isinstance(raw, dict), f"{service}: environment as a mapping, please"
        mounts = bind_mounts(service)
        for key, value in raw.items():
            text = compose_literal(str(value))
            if "://" in text:
                text = self.url(text, service)
            for target, source in mounts.items():
                if text == target or text.startswith(target + "/"):
                    text = str(source) + text[len(target) :]
            env[key] = text
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

    def cwd(self, service: str) -> Path:
        """The service's working directory: an empty one of its own (Redis keeps its AOF
        there; the image's /app is empty too)."""
        path = self.workdir / "cwd" / service
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, service: str) -> None:
        log = open(self.workdir / f"{service}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.logs[service] = log
        cwd = self.cwd(service)
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


def metrics_answer(stack: Stack, service: str) -> bool:
    try:
        response = requests.get(stack.plan.http(service, "/metrics"), timeout=2)
    except requests.RequestException:
        return False
    return response.status_code == 200 and "cchatq_queue_depth" in response.text


def node_name(service: str, hostname: str | None = None) -> str:
    """The worker's Celery node name: `cchatq worker --name N` names it `N@<hostname>`."""
    name = command_flag(SERVICES[service]["command"], "--name") or WORKER_QUEUES[service]
    return f"{name}@{hostname or socket.gethostname()}"


def worker_answers(stack: Stack, service: str) -> bool:
    node = node_name(service)
    replies = stack.celery().control.ping(destination=[node], timeout=1.0)
    return any(node in reply for reply in replies)


# service -> (check, what it waits for)
CHECKS: dict[str, tuple[Callable[[Stack, str], bool], Callable[[str], str]]] = {
    "redis": (redis_answers, lambda _: "PONG"),
    "replay": (http_answers("/healthz", "ok"), lambda _: "200 ok from GET /healthz"),
    "flower": (http_answers("/healthcheck", "OK"), lambda _: "200 OK from GET /healthcheck"),
    "metrics": (metrics_answer, lambda _: "cchatq metrics from GET /metrics"),
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


def test_compose_file_follows_the_compose_specification() -> None:
    raw = SCHEMA_PATH.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SCHEMA_SHA256, "tests/data/README.md: update it"
    schema = json.loads(raw)
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(COMPOSE)
    ]
    assert not errors, "\n".join(errors)
    # the schema is strict where a typo would hide: an unknown key fails
    typo = {"services": {"worker": {"image": "x", "stop_grace_perod": "5m"}}}
    assert not validator.is_valid(typo)
    for text in strings(COMPOSE):  # every `$` is for a container: the host's env changes nothing
        compose_literal(text)


def strings(node: Any) -> Iterator[str]:
    """Every key and value of a parsed YAML document that compose interpolates."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)
    elif isinstance(node, str):
        yield node


def dockerfile_stages(text: str) -> list[list[tuple[str, str]]]:
    """(instruction, arguments) per stage, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    stages: list[list[tuple[str, str]]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        assert stages, f"an instruction before FROM: {line}"
        stages[-1].append((instruction.upper(), args.strip()))
    return stages


def test_the_image_is_built_from_the_dockerfile() -> None:
    for name in PYTHON_SERVICES:
        build = SERVICES[name]["build"]
        assert "dockerfile_inline" not in build, f"{name}: the image's recipe is ./Dockerfile"
        dockerfile = (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()
        assert dockerfile == ROOT / "Dockerfile" and dockerfile.is_file(), dockerfile
    final = dockerfile_stages((ROOT / "Dockerfile").read_text())[-1]
    args = {instruction: [a for i, a in final if i == instruction] for instruction, _ in final}
    assert args["FROM"][0].split()[0] == "python:3.11-slim"
    assert any(re.search(r"\bPYTHONUNBUFFERED=1\b", env) for env in args["ENV"])
    users = args.get("USER", [])
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the image runs as non-root"
    assert args["WORKDIR"][-1] == SERVICES["worker-llm"]["working_dir"]
    installs = [a for a in args["RUN"] if "pip install" in a]
    assert installs and not any(re.search(r"\s(-e|--editable)\s", a) for a in installs)
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    missing = {".git", ".venv", ".env", "**/__pycache__", ".mypy_cache", ".pytest_cache"} - ignored
    assert not missing, f".dockerignore lets these into the build context: {sorted(missing)}"


def test_workers_read_the_mounted_configuration_and_keys_from_env_file(tmp_path: Path) -> None:
    keys_documented = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert all(not value.strip() for value in keys_documented.values()), "no real keys, please"
    assert set(DOTENV) <= set(keys_documented), "what Flower's auth is read from"
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    configs: set[Path] = set()
    for name in PYTHON_SERVICES:
        assert SERVICES[name]["env_file"] == [{"path": ".env", "required": False}], name
        if name in WORKER_QUEUES:
            volumes = [str(v) for v in SERVICES[name]["volumes"]]
            assert any(v.endswith(":ro") for v in volumes), f"{name}: config mounted read-only"
            configs.add(Path(Plan.make(tmp_path).env(name)["CCHATQ_CONFIG"]))
    assert configs == {ROOT / "fixtures" / "config" / "cchatq.json"}, configs
    settings = load_settings({"CCHATQ_CONFIG": str(ROOT / "fixtures" / "config" / "cchatq.json")})
    assert settings.fleet.default_backend == "replay", "the stack runs with no key at all"
    real = {
        name: backend
        for name, backend in settings.fleet.backends.items()
        if backend.base_url.startswith("https://")
    }
    assert {b.protocol for b in real.values()} >= {"anthropic", "openai", "gemini"}
    for name, backend in real.items():
        assert backend.api_key_env in keys_documented, f"{name}: .env.example lacks its key"


def test_workers_stop_after_their_longest_step(tmp_path: Path) -> None:
    """The grace outlasts Celery's hard time limit, which bounds every step but a
    background call's, and each budget under it (compose.yaml says why background gets the
    same grace)."""
    config = ROOT / "fixtures" / "config" / "cchatq.json"
    for name in WORKER_QUEUES:
        env = Plan.make(tmp_path).env(name)
        settings = load_settings(env)
        assert Path(env["CCHATQ_CONFIG"]) == config
        hard_limit_s = float(celery_config(settings)["task_time_limit"])
        budgets_s = {
            "task_time_limit": hard_limit_s,
            "run_timeout_ms cap": RUN_LIMIT_BOUNDS["run_timeout_ms"][1] / 1000,
            "tool timeout cap": TOOL_TIMEOUT_CAP_MS / 1000,
            **{f"backend {b.name}": b.total_timeout_s for b in settings.fleet.backends.values()},
        }
        grace_s = duration_s(SERVICES[name]["stop_grace_period"])
        short = {what: s for what, s in budgets_s.items() if s >= grace_s}
        assert not short, f"{name}: a {grace_s:.0f} s grace cuts {short}"


def test_addresses_name_services_on_the_ports_they_listen_on(tmp_path: Path) -> None:
    plan = Plan.make(tmp_path)
    for name in SERVICES:
        plan.env(name)  # asserts each URL names a listening service on its command's port
        plan.command(name)
    python_env = SERVICES["worker-llm"]["environment"]
    assert urlsplit(python_env["REDIS_URL"]).hostname == "redis"
    assert urlsplit(python_env["CCHATQ_REPLAY_URL"]).hostname == "replay"
    assert urlsplit(python_env["CCHATQ_REPLAY_URL"]).path == "/v1"
    for service in ("flower", "metrics"):
        published = [str(p).rsplit(":", 1)[-1] for p in SERVICES[service].get("ports", [])]
        assert str(plan.compose_ports[service]) in published, f"{service}'s port is published"
        assert all(str(p).startswith("127.0.0.1:") for p in SERVICES[service]["ports"])


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
        page = requests.get(stack.plan.http("flower", "/workers"), auth=FLOWER_AUTH, timeout=5)
        missing = {node for node in nodes if node not in page.text}
        if page.status_code == 200 and not missing:
            return
        if time.monotonic() > deadline:
            log = stack.tail("flower")
            pytest.fail(f"Flower's /workers ({page.status_code}) lacks {sorted(missing)}:\n{log}")
        time.sleep(0.5)


def test_flower_asks_for_the_basic_auth_of_env_and_keeps_its_history(stack: Stack) -> None:
    """FLOWER_BASIC_AUTH (from .env) guards its pages and its API; its task history file is in
    its named volume (--persistent, --db)."""
    stack.wait("flower")
    api = stack.plan.http("flower", "/api/workers")
    assert requests.get(api, timeout=5).status_code == 401
    assert requests.get(api, auth=("compose", "wrong"), timeout=5).status_code == 401
    assert requests.get(api, auth=FLOWER_AUTH, timeout=5).status_code == 200
    command = SERVICES["flower"]["command"]
    assert "--persistent" in command and "FLOWER_BASIC_AUTH" not in " ".join(command)
    db = command_flag(command, "--db")
    assert db is not None
    volume = named_volumes("flower").get(str(Path(db).parent))
    assert volume is not None and volume in COMPOSE["volumes"], f"--db {db}: in no named volume"
    assert list(stack.plan.volume(volume).glob("flower.db*")), "no task history file"


def test_metrics_answers(stack: Stack) -> None:
    stack.wait("metrics")
    assert command_flag(SERVICES["metrics"]["command"], "--address") == "0.0.0.0"


def run_healthcheck(
    stack: Stack, service: str, hostname: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The service's healthcheck as Docker runs it in the container: CMD as the program,
    CMD-SHELL in `sh -c`, where $HOSTNAME is the host name (this machine's here) and PATH
    leads to the image's scripts (here: this Python's)."""
    test = SERVICES[service]["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in {"CMD", "CMD-SHELL"}, f"{service}: {test}"
    env = stack.plan.env(service)
    if test[0] == "CMD":
        argv = stack.plan.args([compose_literal(a) for a in test[1:]], service)
    else:
        assert len(test) == 2, f"{service}: CMD-SHELL takes one command line"
        script = compose_literal(test[1])
        assert "://" not in script, f"{service}: addresses in CMD form, so they can be mapped"
        argv = ["/bin/sh", "-c", script]
        env["HOSTNAME"] = hostname or socket.gethostname()
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(
        argv, cwd=stack.cwd(service), env=env, capture_output=True, timeout=WAIT_S
    )


@pytest.mark.parametrize("service", HEALTHCHECKED)
def test_healthcheck_passes(stack: Stack, service: str) -> None:
    stack.wait(service)
    done = run_healthcheck(stack, service)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_worker_has_a_healthcheck_on_its_own_node() -> None:
    for service in WORKER_QUEUES:
        test = SERVICES[service].get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD-SHELL", f"{service}: no shell healthcheck"
        assert compose_literal(test[-1]).split()[-2:] == ["-d", node_name(service, "$HOSTNAME")]


def test_worker_healthcheck_fails_for_another_node(stack: Stack) -> None:
    """It pings its own worker only: a host name no worker has answers nothing, and fails."""
    stack.wait("worker-llm")
    done = run_healthcheck(stack, "worker-llm", hostname="no-such-host")
    assert done.returncode != 0, done.stdout + done.stderr
    assert b"No nodes replied" in done.stdout + done.stderr


def test_redis_appends_every_write_to_its_aof(stack: Stack, tmp_path: Path) -> None:
    """A write reaches the AOF in Redis's data dir, and a Redis started by the same command on
    a copy of that dir (a restarted container on its volume) has it back."""
    stack.wait("redis")
    spec = SERVICES["redis"]
    assert "/data" in {str(v).split(":")[1] for v in spec["volumes"]}
    named = {str(v).split(":")[0] for v in spec["volumes"]}
    assert named <= set(COMPOSE.get("volumes") or {}), "Redis's data is in a named volume"
    key = f"compose-test:aof:{os.getpid()}"
    with redis.Redis(host=LOCAL, port=stack.plan.local_ports["redis"]) as client:
        config = client.config_get("append*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec", config
        client.set(key, "kept")
    aof_dir = stack.cwd("redis") / "appendonlydir"
    deadline = time.monotonic() + WAIT_S
    while not any(key.encode() in aof.read_bytes() for aof in aof_dir.glob("*.aof")):
        assert time.monotonic() < deadline, f"{key} never reached the AOF in {aof_dir}"
        time.sleep(0.1)
    shutil.copytree(aof_dir, tmp_path / "appendonlydir")
    port = free_port()
    command = [
        str(port) if prev == "--port" else arg
        for prev, arg in itertools.pairwise(["", *stack.plan.command("redis")])
    ]
    restarted = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        with redis.Redis(host=LOCAL, port=port, socket_connect_timeout=0.5) as client:
            deadline = time.monotonic() + WAIT_S
            while True:
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                    assert client.get(key) == b"kept"
                    break
                assert restarted.poll() is None, f"redis exited with {restarted.returncode}"
                assert time.monotonic() < deadline, "the restarted Redis never answered"
                time.sleep(0.1)
    finally:
        _signal_group(restarted, signal.SIGTERM)
        restarted.wait(timeout=STOP_GRACE_S)
