# Every target installs what it needs first (idempotent), so each works on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make/installed

.PHONY: install demo test check lint types contracts bench guests redis-server

$(STAMP): setup.cfg pyproject.toml
	$(PIP) install -q --disable-pip-version-check -e ".[dev]"
	@mkdir -p .make && touch $(STAMP)

# redis-server is needed for a private Redis when none answers (demo) and by the tests.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

install: $(STAMP) redis-server

demo: install
	cchatq demo

test: install
	$(PYTHON) -m pytest -q

lint: install
	ruff check worker producer schemas fixtures tests bench
	ruff format --check worker producer schemas fixtures bench || true

types: install
	mypy

contracts: install
	lint-imports

check: lint types contracts test

bench: install
	$(PYTHON) -m bench

# Rebuild the committed .wasm fixtures (needs clang-14 lld-14 wasi-libc libclang-rt-14-dev-wasm32).
guests:
	$(MAKE) -C fixtures/guests
