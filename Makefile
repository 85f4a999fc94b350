# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates the virtual environment in .venv when it is missing (the newest Airflow 3), after
# installing libfuse (scripts/system_packages.sh fuse, as root, when missing); `make test` also
# installs PostgreSQL and Chromium (scripts/system_packages.sh deployment) for the deployment tests,
# which it runs (DEPLOYMENT_TESTS=0 skips them); `make demo` needs neither.
# TESTS_REQUIRE_FULL_ENV=1 (.ci/run sets it) makes a missing FUSE or framework extra fail the tests
# that need it instead of skipping them (tests/conftest.py).
# `make test-airflow2` creates .venv-airflow2 (Airflow 2.11, pinned by constraints/airflow2.txt)
# and runs the provider, trigger, sensor and example-DAG tests there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENV2 := .venv-airflow2
PY2 := $(VENV2)/bin/python
STAMP2 := $(VENV2)/.installed
# Everything a development checkout uses besides the worker and the emulator (their own
# distributions, worker/ and emulator/, installed editable beside it): the example DAGs' imports, tests,
# the bundled worker's torch, the benchmarks' plots, the local Airflow deployment (make stack)
# and the documentation site (make docs: a few small pure-Python wheels, so one environment).
EXTRAS := examples,dev,deployment,docs
# Airflow 2.11 runs no deployment tests (they need Airflow 3's API server): no deployment extra there.
EXTRAS_AIRFLOW2 := examples,dev
# The worker library's own distribution (worker/pyproject.toml), editable, with the bundled trainer's extra
# and the framework integrations' extras (their tests run in CI, on Airflow 3's environment only).
WORKER_EXTRAS := trainer,transformers,lightning
WORKER_EXTRAS_AIRFLOW2 := trainer
# The tests that exercise the provider against an Airflow release: hook, operators, sensor,
# trigger, links, provider metadata and packaging, and the example DAGs (parsing, rendering and
# two end-to-end runs through `airflow dags test`), and the google provider's own Cloud Run
# operators against the emulator on their default gRPC transport. Not the unit tests that import neither Airflow
# nor a Google client (the goodput account, the job-cleanup decision table, the test suite's own
# TESTS_REQUIRE_FULL_ENV switch, the save-cost benchmark's tables): pure Python, the same on either release. Nor the training
# chained through several task timeouts (minutes of real worker attempts): what it adds to the
# other re-run tests of its file, which run here, is the worker's deadline stop, which does not
# depend on the Airflow release (the operator's re-run path is the same code on both). Nor the
# chains of every way in (test_framework_chains.py): its framework jobs need the extras this
# environment does not install, and its operator path is the one the re-run tests run here. Nor
# the goodput accounts of the bundled worker's runs (twenty preemptions in start-up; a failed
# task's uncommitted steps): the account is the provider's own arithmetic on Cloud Run's attempt
# times and the worker's files, the same code on both releases, and the operator path around it
# runs here in the other re-run tests. The other tests with an emulator of their own run here
# over gRPC only (their REST variants on Airflow 3: tests/provider/conftest.py deselects them
# here and says why).
AIRFLOW2_TESTS := tests/unit tests/provider tests/system/test_dags.py tests/emulator/test_google_provider.py \
	--ignore=tests/unit/test_goodput.py --ignore=tests/unit/test_job_cleanup.py --ignore=tests/unit/test_full_env_switch.py \
	--ignore=tests/unit/test_bench_save_cost.py --ignore=tests/provider/operators/test_framework_chains.py \
	--ignore=tests/provider/operators/test_goodput_billing.py \
	--deselect tests/provider/operators/test_progress_reruns.py::test_a_training_of_about_five_task_timeouts_finishes_through_timed_out_executions \
	--deselect tests/provider/operators/test_progress_reruns.py::test_a_failed_tasks_account_counts_its_uncommitted_steps_as_wasted

# Bytecode for everything installed, compiled on every core: pip compiles one file at a time,
# which was most of the install's time. Not skipped: where PYTHONDONTWRITEBYTECODE is set, every
# process would compile its imports again (an Airflow and torch import takes twice as long). A file
# that does not compile (a template or test data with a .py name) is skipped, as pip skips it.
COMPILE := bash scripts/compile_site_packages.sh

.PHONY: venv venv-airflow2 demo docs stack test test-deployment test-airflow2 check-install test-faults-long bench bench-checkpoint bench-goodput bench-orchestration bench-emulator bench-save-cost bench-watch-scale clean

venv: $(STAMP)

$(STAMP): pyproject.toml worker/pyproject.toml emulator/pyproject.toml constraints/dev.txt
	bash scripts/system_packages.sh fuse
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints/dev.txt -e '.[$(EXTRAS)]' -e './worker[$(WORKER_EXTRAS)]' -e ./emulator
	$(COMPILE) $(PY)
	touch $(STAMP)

venv-airflow2: $(STAMP2)

$(STAMP2): pyproject.toml worker/pyproject.toml emulator/pyproject.toml constraints/dev.txt constraints/airflow2.txt
	test -x $(PY2) || $(PYTHON) -m venv $(VENV2)
	$(PY2) -m pip install --quiet --upgrade pip
	$(PY2) -m pip install --quiet --no-compile -c constraints/dev.txt -c constraints/airflow2.txt -e '.[$(EXTRAS_AIRFLOW2)]' -e './worker[$(WORKER_EXTRAS_AIRFLOW2)]' -e ./emulator
	$(COMPILE) $(PY2)
	touch $(STAMP2)

demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

# The documentation site (docs/, Sphinx) into build/docs/html: every warning is an error (-W;
# --keep-going lists all of them first), every cross-reference must resolve (-n), and every page
# is read again (-E), so a warning in a page that did not change still fails the build.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs build/docs/html
	@echo "docs: build/docs/html/index.html"

# Only the real Airflow deployment's tests (PostgreSQL, scheduler, DAG processor, triggerer, API
# server, headless Chromium; about 10 minutes on 2 cores). `make test` runs them too
# (DEPLOYMENT_TESTS=0 skips them there).
test-deployment: $(STAMP)
	bash scripts/system_packages.sh deployment
	$(PY) -m pytest tests/deployment $(PYTEST_ARGS)

# A real deployment (PostgreSQL, scheduler, DAG processor, triggerer, API server and UI, the
# emulators) on loopback until Ctrl-C; it prints the UI's address and login.
stack: $(STAMP)
	bash scripts/system_packages.sh deployment
	$(PY) scripts/airflow_stack.py $(STACK_ARGS)

# Everything under tests/, the deployment tests included: PostgreSQL and Chromium first.
# scripts/run_tests.sh runs it in two pytest runs: the tests not marked serial on three
# pytest-xdist workers (TEST_WORKERS), then the serial ones (timing-sensitive: real worker
# processes against task timeouts and grace periods, the deployment) alone.
test: $(STAMP)
	bash scripts/system_packages.sh deployment
	bash scripts/run_tests.sh $(PY) $(PYTEST_ARGS)

test-airflow2: $(STAMP2)
	bash scripts/run_tests.sh $(PY2) $(AIRFLOW2_TESTS) $(PYTEST_ARGS)

# Build the wheel and install it, without the emulator (its own distribution), into fresh virtual environments
# with Airflow 2.11 and with the newest Airflow 3; each must list the provider and parse the
# example DAGs with no import errors.
check-install: $(STAMP)
	$(PY) scripts/check_install.py $(CHECK_ARGS)

# The fault-injection suite at full size (CI runs it bounded, as part of `make test`).
test-faults-long: $(STAMP)
	FAULTS_N=200 $(PY) -m pytest -m faults $(PYTEST_ARGS)

# Benchmarks print tables and write JSON (and PNG plots) under benchmarks/results/.
bench: bench-checkpoint bench-goodput bench-orchestration bench-emulator bench-save-cost bench-watch-scale

bench-checkpoint: $(STAMP)
	$(PY) benchmarks/bench_checkpoint.py $(BENCH_ARGS)

bench-goodput: $(STAMP)
	$(PY) benchmarks/bench_goodput.py $(BENCH_ARGS)

bench-orchestration: $(STAMP)
	$(PY) benchmarks/bench_orchestration.py $(BENCH_ARGS)

bench-emulator: $(STAMP)
	$(PY) benchmarks/bench_emulator.py $(BENCH_ARGS)

# N = 1 to 1,000 deferred executions: the per-execution polling trigger vs the shared watcher
bench-watch-scale: $(STAMP)
	$(PY) benchmarks/bench_watch_scale.py $(BENCH_ARGS)

# the defaults (256 MiB); the issue's setting: BENCH_ARGS="--skip-e2e --skip-io --hidden 3584
# --modes none raw sync async --grid 1800:6 --dir /dev/shm/bench" (see docs/benchmarks.rst)
bench-save-cost: $(STAMP)
	$(PY) benchmarks/bench_save_cost.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV2) .pytest_cache build dist *.egg-info worker/*.egg-info worker/build
