#!/usr/bin/env bash
# The whole test suite: serial tests, then the MPI tests at world sizes 1..5, then the large test
# at P = 2. Any failure on any rank fails the run (pytest -x exits non-zero, mpiexec propagates it;
# `timeout` turns a hang into a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The serial tests on every core (pytest-xdist; GIFTCOMM_TEST_WORKERS overrides, 0 = in this process):
# most of them run in-process on one core, and the ones that launch jobs wait on them.
workers="${GIFTCOMM_TEST_WORKERS:-$(nproc)}"
timeout 1200 python -m pytest -m "not mpi" -q -n "$workers" --dist loadgroup --durations=20 "$@"
# Only the modules that hold MPI tests are collected under mpiexec (each rank collects them).
mpi_modules=$(grep -l 'mark\.mpi' tests/test_*.py)
for p in 1 2 3 4 5; do
    echo "=== MPI tests at P=$p ==="
    select="mpi and not big"
    [ "$p" -eq 1 ] && select="$select and not multirank"  # tests of ranks that differ need two
    timeout 600 mpiexec -n "$p" python -m pytest -m "$select" --with-mpi -q -x -p no:cacheprovider "$@" $mpi_modules
done
echo "=== large MPI test at P=2 ==="
timeout 900 mpiexec -n 2 python -m pytest -m big --with-mpi -q -x -p no:cacheprovider "$@" $mpi_modules
