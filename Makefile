# constraints.txt pins every package CI installs (regenerate: pip freeze in a working .venv).
# Two entry points a newcomer needs: `make demo` and `make test`. Both create ./.venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo install-test test lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python

# Install kvbucket with what the demo needs (torch CPU + transformers), then run it.
demo: venv
	$(BIN)/pip install -q -c constraints.txt -e '.[transformers]'
	$(BIN)/kvbucket demo

# compileall: an editable install leaves src/ without bytecode, and where PYTHONDONTWRITEBYTECODE is
# set (this machine's shells set it) every `kvbucket` run and every child process the suite starts
# would compile each module it imports again (`kvbucket ls` 0.27 s of CPU instead of 0.19).
install-test: venv
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m compileall -q src

lint: install-test
	$(BIN)/ruff check src tests benchmarks

# The whole suite on TEST_WORKERS pytest-xdist workers (each starts its own servers: Hub emulator,
# S3 server, on 127.0.0.1). Two workers on 2 cores: much of the suite waits (servers, deadlines,
# child processes), so a second worker computes meanwhile; worksteal rebalances the long tests at
# the end. `make test TEST_WORKERS=0` runs it in one process. The 25 slowest tests are listed at the
# end, so that a CI log shows where the suite's time goes.
TEST_WORKERS ?= 2

test: install-test lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25
