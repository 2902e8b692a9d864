# Two entry points for a fresh machine: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The venv ships the temporal CLI and moto_server; tests and the demo find them here.
export PATH := $(abspath $(BIN)):$(PATH)
STAMP := $(VENV)/.installed
# Test files side by side, each on one worker with its own Temporal dev server and moto (session fixtures): most
# tests wait on servers and timers, not the CPU, so five fit two cores. Six are faster still (2026-12-07, `7c62a9f`,
# nothing else running: -n 5 9 min 42 s and 9 min 55 s, -n 6 9 min 11 s, 9 min 20 s and 9 min 30 s), but the third
# -n 6 run failed the durability test's mid-call kills: four healthy instances taken for lost under the extra load.
# `make test PYTEST_ARGS=` runs them in turn.
PYTEST_ARGS ?= -n 5 --dist loadfile --durations=15

# The Web UI browser test drives Debian's chromium headless; installed here when missing (root, or sudo).
CHROMIUM ?= /usr/bin/chromium
# The journald source's tests write real journal files with Debian's systemd-journal-remote; installed the same way.
JOURNAL_REMOTE ?= /lib/systemd/systemd-journal-remote
# The probe's launch-template installer (deploy/systemd/install-probe.sh) is checked with Debian's shellcheck.
SHELLCHECK ?= /usr/bin/shellcheck
PROMTOOL ?= /usr/bin/promtool
# The dashboard and firing-alert tests run Debian's Prometheus server, from the same package as promtool.
PROMETHEUS ?= /usr/bin/prometheus
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo test lint install browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

browser: $(CHROMIUM)

$(JOURNAL_REMOTE):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd-journal-remote

$(SHELLCHECK):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck

# promtool checks and unit-tests the alert rules (deploy/prometheus/); the server runs the dashboard's queries.
$(PROMTOOL) $(PROMETHEUS):
	$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus

demo: $(STAMP)
	$(BIN)/autorepair demo $(DEMO_ARGS)

test: $(STAMP) $(CHROMIUM) $(JOURNAL_REMOTE) $(SHELLCHECK) $(PROMTOOL) $(PROMETHEUS)
	$(BIN)/ruff check .
	$(BIN)/mypy contract workflows activities worker node_probe ingest operator_cli simulator
	$(BIN)/pytest $(PYTEST_ARGS)

# The tests and benchmarks are typed too; checked here, not in `make test`, where they would add a minute and a half.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy contract workflows activities worker node_probe ingest operator_cli simulator tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .state
