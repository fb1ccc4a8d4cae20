# Entry points for a fresh clone: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast pull clean

install:
	VENV=$(VENV) bash scripts/install.sh

pull: install
	$(PY) -m tessera pull $(MODEL)

serve: pull
	$(PY) -m tessera serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# For iteration: everything but the tests that need a real packaged model (`model`) and the
# few that take more than a few seconds each (`slow`); `make test` runs them all.
test-fast: install
	$(PY) -m pytest -m "not model and not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
