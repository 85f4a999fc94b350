# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates the virtual environment in .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-faults-long bench bench-checkpoint bench-goodput bench-orchestration bench-emulator clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/dev.txt -e '.[worker,dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The fault-injection suite at full size (CI runs it bounded, as part of `make test`).
test-faults-long: $(STAMP)
	FAULTS_N=200 $(PY) -m pytest -m faults $(PYTEST_ARGS)

# Benchmarks print tables and write JSON (and PNG plots) under benchmarks/results/.
bench: bench-checkpoint bench-goodput bench-orchestration bench-emulator

bench-checkpoint: $(STAMP)
	$(PY) benchmarks/bench_checkpoint.py $(BENCH_ARGS)

bench-goodput: $(STAMP)
	$(PY) benchmarks/bench_goodput.py $(BENCH_ARGS)

bench-orchestration: $(STAMP)
	$(PY) benchmarks/bench_orchestration.py $(BENCH_ARGS)

bench-emulator: $(STAMP)
	$(PY) benchmarks/bench_emulator.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
