#!/usr/bin/env bash
# Compile the bytecode of a virtual environment's site-packages on every core: usage
# `compile_site_packages.sh PYTHON` (the Makefile's venv targets install with pip's --no-compile,
# which otherwise compiles one file at a time). compileall exits 1 when any file does not compile
# (some packages ship templates or test data with a .py name; pip skips those too), so its exit
# status is not the test: the command fails only when Python itself cannot run it.
set -uo pipefail
python=$1
site=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || exit 1
"$python" -m compileall -q -j 0 "$site" >/dev/null 2>&1
status=$?
if [[ $status -gt 1 ]]; then
    echo "compileall of $site failed with exit $status" >&2
    exit "$status"
fi
exit 0
