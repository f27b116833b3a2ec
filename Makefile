# Every target installs what it needs first (idempotent), into a private virtualenv (.venv):
# nothing is installed into the system Python, so each target works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the venv's console scripts (cchatq, celery, ruff, mypy, lint-imports) come first
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Coverage of worker/ by the in-process tests (steps, hostcalls, codecs, engine through the
# twins); worker subprocesses of the fleet tests are not measured.
COVERAGE_FLOOR := 85

.PHONY: install demo test test-fast check lint types contracts cover bench bench-big bench-otel bench-rate \
	bench-scale chaos soak guests \
	redis-server faketime nftables chromium screenshots

$(PY):
	$(PYTHON) -m venv $(VENV) || { \
	  echo "installing python3-venv (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv) >/dev/null \
	  && $(PYTHON) -m venv $(VENV); }

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

# redis-server is needed for a private Redis when none answers (demo) and by the tests.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

# libfaketime: the clock-skew fleet test and chaos scenario start workers whose wall clock is
# off (fixtures/clock_skew.py preloads Debian's library; the test is skipped without it).
faketime:
	@ls /usr/lib/*/faketime/libfaketimeMT.so.1 >/dev/null 2>&1 || { \
	  echo "installing libfaketime (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfaketime) >/dev/null; }

# nftables: `nft` cuts a test host's link silently, `ip` (iproute2) makes the host (bench/netns.py:
# the partition fleet test and chaos scenarios, which run as root and skip when either is missing).
nftables:
	@{ command -v nft && command -v ip; } >/dev/null 2>&1 || { \
	  echo "installing nftables iproute2 (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2) \
	  >/dev/null; }

# chromium: the browser the viewer's browser tests (Playwright) drive headless, Debian's own
# build at /usr/bin/chromium; Playwright's downloaded browsers are never used (`playwright
# install` is not run), so the tests need no network beyond the package mirrors.
chromium:
	@test -x /usr/bin/chromium || { \
	  echo "installing chromium (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; }

install: $(STAMP) redis-server faketime nftables chromium

demo: install
	$(PY) -m producer.cli demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the suite without the fleet tests: no Redis, workers or replay server started (about 2 min)
test-fast: install
	$(PY) -m pytest -q -m "not fleet" $(PYTEST_ARGS)

lint: install
	ruff check worker producer schemas fixtures tests bench
	ruff format --check worker producer schemas fixtures tests bench

types: install
	mypy

contracts: install
	lint-imports

# the whole suite, with the coverage report for worker/ and its floor
cover: install
	$(MAKE) test PYTEST_ARGS="--cov=worker --cov-report=term:skip-covered --cov-fail-under=$(COVERAGE_FLOOR)"

check: lint types contracts cover

bench: install
	$(PY) -m bench

# The producer's side of a 100,000-session batch against its goals (submit's time and memory,
# batch status and the viewer's page, results written as sessions end), on a private Redis
# without workers, the sessions ended by the workers' own script. BENCH_BIG_ARGS="--sessions 20000"
bench-big: install
	$(PY) -m bench.big_batch --sessions 100000 $(BENCH_BIG_ARGS)

# What OpenTelemetry spans cost the workers: the same batch with spans off and exporting over
# OTLP/HTTP to a receiver in the bench's process. BENCH_OTEL_ARGS="--sessions 200 --content"
bench-otel: install
	$(PY) -m bench.otel $(BENCH_OTEL_ARGS)

# Sessions/s on 1, 2, 4, 8 and 16 worker units (one llm, tools and control worker each; the
# sizes with 2 cores a unit on this machine), state on a plain Redis and on a 3-master cluster,
# the broker on a Redis of its own (not part of test). A short run:
# make bench-scale BENCH_SCALE_ARGS="--sizes 1,2 --sessions-per-unit 200"
bench-scale: install
	$(PY) -m bench.scale $(BENCH_SCALE_ARGS)

# The fleet under failure, not part of test: workers SIGKILLed every 2 s,
# Redis restarted mid-batch, 429s and 500s from the model, the producer killed while it waits.
# One scenario or more: make chaos SCENARIOS="kill faults"; with the broker on the local RabbitMQ
# (kill, faults): make chaos SCENARIOS=kill CCHATQ_CHAOS_BROKER=amqp [CCHATQ_CHAOS_QUEUE_TYPE=quorum]
chaos: install
	$(PY) -m bench.chaos $(SCENARIOS)

# A steady mixed load for an hour with a worker SIGKILLed every minute and the llm and tools
# workers' host cut off 30 s every 10 minutes (not part of test; the cuts need root, `ip` and
# `nft`, else it runs without them and says so): worker memory, file descriptors and Redis memory
# sampled, their slopes per hour printed, and every batch's history checked. A 10-minute run:
# make soak SOAK_ARGS="--minutes 10 --ttl-s 240 --settle-s 120 --partition-every-s 150"
soak: install
	$(PY) -m bench.soak $(SOAK_ARGS)

# The adaptive rate controller against a provider's rate limit (not part of test): per protocol,
# 3,600 one-call sessions at 20 requests/s, the limit halved then restored, a worker joining.
# A 1-minute smoke run: make bench-rate BENCH_RATE_ARGS="--scale 0.25 --protocols openai"
bench-rate: install
	$(PY) -m bench.rate $(BENCH_RATE_ARGS)

# The pictures of `cchatq view` in docs/images/ (runs, a batch, a two-round session at
# 1280x800), taken in headless chromium from a demo batch on a private fleet.
screenshots: install
	$(PY) -m bench.screenshots

# Rebuild the committed .wasm fixtures (needs clang-14 lld-14 wasi-libc libclang-rt-14-dev-wasm32).
guests:
	$(MAKE) -C fixtures/guests
