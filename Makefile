# The two commands of the README, and a few more. Each one sets up .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: test demo bench docs clean

# torch is pinned for development (a CPU wheel this machine serves from disk);
# the package itself accepts a range.
$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[all,dev]'
	touch $(READY)

# The tests run in 4 processes, a file's tests together (tests/conftest.py says how).
# Most of a test's time is spent waiting on the processes and sockets it starts, so 4
# beat 2 on two cores; `make test TEST_JOBS=0` runs them all in this one process.
TEST_JOBS ?= 4
test: $(READY)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

demo: $(READY)
	$(BIN)/somatize demo

docs: $(READY)
	$(BIN)/mkdocs build --strict

bench: $(READY)
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis demo-store demo-report.html site
