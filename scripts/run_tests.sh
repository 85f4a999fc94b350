#!/usr/bin/env bash
# The test runs of `make test` and `make test-airflow2`: usage `run_tests.sh PYTHON [pytest args]`.
#
# 1. The tests not marked `serial` on TEST_WORKERS pytest-xdist workers (default 3), whole
#    files to a worker (--dist loadfile, so a module's fixtures are built once). Much of their
#    time is spent waiting on subprocesses and the emulators, so three workers keep two cores
#    busier than two workers do.
# 2. The tests marked `serial` alone, in one process: real worker processes against wall-clock
#    task timeouts, deadlines and grace periods, latency bounds, and the real Airflow
#    deployment (tests/deployment). Sharing the cores with another test slowed e.g. the
#    worker's start-up past a 20 s task timeout, so they never run beside one
#    (tests/conftest.py refuses them on more than one xdist worker).
#
# Both runs happen even if the first fails; the exit status is the first failure's (pytest's
# 5, "no tests selected", counts as a pass for one run when the other ran tests).
# TEST_WORKERS=0 runs the first group in one process too (no xdist). TEST_PART=parallel or
# TEST_PART=serial runs only that run (.ci/run orders the parts of its two suites itself).
set -uo pipefail
python=$1
shift
workers=${TEST_WORKERS:-3}
part=${TEST_PART:-all}
case "$part" in
    all|parallel|serial) ;;
    *) echo "TEST_PART=$part: use all, parallel or serial" >&2; exit 4 ;;
esac

first=5
second=5
if [[ $part != serial ]]; then
    "$python" -m pytest -m "not serial" -n "$workers" --dist loadfile "$@"
    first=$?
fi
if [[ $part != parallel ]]; then
    "$python" -m pytest -m serial "$@"
    second=$?
fi

if [[ $first == 5 && $second == 5 ]]; then
    exit 5
fi
for status in "$first" "$second"; do
    if [[ $status != 0 && $status != 5 ]]; then
        exit "$status"
    fi
done
exit 0
