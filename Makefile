# The project's own commands; CI calls `make test` too. Everything installs into .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test's worker processes (pytest-xdist): the suite mostly waits (fsync, child processes, leases),
# so one per core and one more (on 2 cores: 13 min against 14.5 with one per core, 2026-12-06);
# TEST_WORKERS=0 runs it in this process. Work stealing: a worker that runs out takes tests queued for another,
# so the run does not end on one worker's long tail.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))

.PHONY: install bytecode run test test-slow test-openclaw test-hermes interop-deps pgbouncer lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/transcript-store gateway --engine lossless

# The suite starts a few thousand Python processes (CLI calls, servers, workers killed and restarted). Where
# PYTHONDONTWRITEBYTECODE is set (it is on the machines this project is tested on) none of them writes bytecode, so each compiled the modules
# it imports from source again (~0.1 s of CPU per server start): compiled once here instead (compileall writes
# whatever that variable says; a source edited later is compiled anew as usual, its stale file ignored).
bytecode: install
	$(BIN)/python -m compileall -q -j 0 transcript_store engines tests bench > /dev/null

test: bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not openclaw and not hermes" $(PYTEST_ARGS)

test-slow: bytecode
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The plugin inside the real OpenClaw: Node and OpenClaw are cached in .cache/openclaw (npm registry). Its tests
# are independent hosts (own directories and ports) that mostly wait for Node: with TEST_WORKERS > 1 they run
# side by side (CI runs them one at a time, beside make test).
test-openclaw: bytecode
	TRANSCRIPT_STORE_OPENCLAW=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m openclaw tests/interop $(PYTEST_ARGS)

# The plugin inside the real Hermes Agent: hermes-agent==0.19.0 + this project in .cache/hermes-venv.
HERMES_VENV := .cache/hermes-venv
HERMES_STAMP := $(HERMES_VENV)/.installed-stamp

$(HERMES_STAMP): pyproject.toml
	test -x $(HERMES_VENV)/bin/python || $(PYTHON) -m venv $(HERMES_VENV)
	$(HERMES_VENV)/bin/python -m pip install --quiet hermes-agent==0.19.0 pytest
	$(HERMES_VENV)/bin/python -m pip install --quiet -e .
	touch $(HERMES_STAMP)

# What test-hermes and test-openclaw install (hermes-agent into its venv; Node and OpenClaw into .cache/openclaw),
# without running them: CI fetches these while `make test` runs.
interop-deps: install $(HERMES_STAMP)
	$(BIN)/python -c "import sys; sys.path.insert(0, 'tests/interop'); import openclaw_host; openclaw_host.install()"

test-hermes: $(HERMES_STAMP)
	$(HERMES_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/interop/test_hermes.py tests/interop/test_hermes_sessions_review2.py tests/interop/test_hermes_undo_review3.py tests/interop/test_hermes_undo_review4.py tests/interop/test_hermes_retry_after_undo_s41.py tests/interop/test_hermes_retry_switch_s41.py tests/interop/test_hermes_review_s41b.py tests/interop/test_hermes_saved_spelling_s42.py tests/interop/test_hermes_review_s42.py tests/interop/test_hermes_persist_user_s42.py tests/test_hermes_adapter.py $(PYTEST_ARGS)

# PgBouncer, for the pooler tests (tests/test_pgbouncer_s43.py start their own process; no service is used):
# Debian's package when the program is missing, the package lists fetched only when apt-get cannot find it.
PGBOUNCER_FOUND ?= command -v pgbouncer > /dev/null || test -x /usr/sbin/pgbouncer
APT_GET = $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Dpkg::Use-Pty=0
pgbouncer:
	@$(PGBOUNCER_FOUND) || { \
	    command -v apt-get > /dev/null || { echo "pgbouncer is missing and there is no apt-get: install PgBouncer"; exit 1; }; \
	    echo "installing pgbouncer (Debian package)"; log=$$(mktemp); \
	    { $(APT_GET) install pgbouncer > $$log 2>&1 \
	      || { $(APT_GET) update && $(APT_GET) install pgbouncer; } >> $$log 2>&1; } \
	    || { cat $$log; rm -f $$log; echo "installing pgbouncer (apt-get install pgbouncer) failed"; exit 1; }; \
	    rm -f $$log; \
	    command -v pgbouncer > /dev/null || test -x /usr/sbin/pgbouncer \
	    || { echo "apt-get installed pgbouncer, but there is no pgbouncer program"; exit 1; }; \
	}

lint: install
	$(BIN)/ruff check transcript_store engines tests bench
	$(BIN)/mypy transcript_store engines bench

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
