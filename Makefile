# `make run` and `make test` work from a fresh clone: they create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest workers; each takes whole test files (--dist loadfile), so a module-scoped fixture runs once.
# Two workers keep both CI cores busy: the suite took 25.8 against 31.5 min on a 2-core machine.
TEST_JOBS ?= 2
RUN_ARGS ?=
# Python's compiled bytecode under .cache/pycache (not beside the sources), written even where the environment
# sets PYTHONDONTWRITEBYTECODE (as some do): without it every process compiles the ~540 modules it imports
# (jax's among them) from source again, 5.4 against 2.5 s to import Tessera, and the suite starts many processes.
PYENV  := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/.cache/pycache

.PHONY: run test venv clean

# --no-compile: pip byte-compiles every module it installs (jax, scipy, ...: 41 against 20 s of CPU on 2 cores);
# Python compiles the ones a run imports, once, on first import
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile --upgrade pip
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PYENV) $(BIN)/tessera run specs/gpt_oss_tiny.yaml $(RUN_ARGS)

test: $(STAMP)
	$(PYENV) $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .cache
