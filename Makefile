# `make demo` and `make test` work on a fresh machine: they create .venv and install everything.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned for dev/CI (a CPU build lies on this machine's disk); pyproject admits a range.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test test-quick lint venv bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test,bench,lint,examples]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/msdata-server demo

test: venv  # the whole suite: about 4-5 minutes on 2 cores
	$(BIN)/python -m pytest -q tests

# pure functions and the command line, no server processes: about 30 s (tests/test_packaging.py checks the list)
QUICK_TESTS := tests/test_balance.py tests/test_exchange.py tests/test_graph.py tests/test_mesh.py tests/test_mixture.py \
	tests/test_planner.py tests/test_pieces.py tests/test_ring.py tests/test_cli_errors.py tests/test_packaging.py \
	tests/test_job_reference.py tests/test_status_view.py

test-quick: venv
	$(BIN)/python -m pytest -q $(QUICK_TESTS)

# ruff (lint, then formatting), mypy (configured in pyproject.toml) and the structure test (cycles, seams,
# size, ARCHITECTURE naming every module); CI runs it before the tests
lint: venv
	$(BIN)/ruff check msdata_client msdata_server tests bench examples && \
		$(BIN)/ruff format --check msdata_client msdata_server tests bench examples && \
		$(BIN)/mypy && \
		$(BIN)/python -m pytest -q tests/test_structure.py

bench: venv  # every benchmark in bench/ (--quick); their JSON and the plots go to bench/results/ (each one's --smoke runs in make test: tests/test_bench_smoke.py)
	$(BIN)/python bench/suite.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
