#!/usr/bin/env bash
# The test suite, in two tiers (README.md, "Two commands", gives the times on a 2-core machine):
#   bash tests/run_all.sh          the fast tier: the modules of FAST_MODULES in tests/conftest.py
#                                  (the tables, the codecs, the collectives, the invariants' home
#                                  modules), then their MPI tests at P = 1..5
#   bash tests/run_all.sh --full   the full tier (CI; GIFTCOMM_TESTS=full does the same): every
#                                  serial test, the MPI tests at P = 1..5, the large test at P = 2
# Other arguments go to every pytest. Any failure on any rank fails the run (pytest -x exits
# non-zero, mpiexec propagates it).
#
# Limits, so that a hang fails with a message instead of blocking the run:
# - every test: GIFTCOMM_TEST_TIMEOUT seconds (default 900, pytest-timeout); a test past it fails
#   with its name and its threads' stacks, and the run goes on to report it;
# - every stage: an outer limit for a hang outside any test (collection, start-up, mpiexec);
#   a stage past it stops with "run_all.sh: stage '<name>' ran past its limit of <N> s".
# GIFTCOMM_TEST_TIME_SCALE (default 1) multiplies every limit, for a slow or loaded machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

tier="${GIFTCOMM_TESTS:-fast}"
args=()
for a in "$@"; do
    case "$a" in
        --full) tier=full ;;
        --fast) tier=fast ;;
        *) args+=("$a") ;;
    esac
done
case "$tier" in
    fast | full) ;;
    *) echo "run_all.sh: GIFTCOMM_TESTS is '$tier'; it takes 'fast' or 'full'" >&2; exit 2 ;;
esac
scale="${GIFTCOMM_TEST_TIME_SCALE:-1}"
scaled() { awk -v s="$1" -v k="$scale" 'BEGIN { v = int(s * k); if (v < 1) exit 1; print v }' ||
    { echo "run_all.sh: GIFTCOMM_TEST_TIME_SCALE must be a positive number, not '$scale'" >&2; exit 2; }; }
per_test=$(scaled "${GIFTCOMM_TEST_TIMEOUT:-900}")
started=$SECONDS

# stage NAME LIMIT_S COMMAND...: run COMMAND; when it passes LIMIT_S (scaled), stop it and fail
# with a message naming the stage and the limit; any other failure keeps COMMAND's exit status.
stage() {
    local name=$1 limit rc=0 t0=$SECONDS
    limit=$(scaled "$2")
    shift 2
    echo "=== $name (stage limit $limit s, per test $per_test s) ==="
    timeout --kill-after=30 "$limit" "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "run_all.sh: stage '$name' ran past its limit of $limit s and was stopped" \
             "(set GIFTCOMM_TEST_TIME_SCALE to scale every limit on a slow machine)" >&2
        exit 124
    elif [ "$rc" -ne 0 ]; then
        echo "run_all.sh: stage '$name' failed (exit status $rc)" >&2
        exit "$rc"
    fi
    echo "--- $name: passed in $((SECONDS - t0)) s"
}

workers="${GIFTCOMM_TEST_WORKERS:-$(nproc)}"  # pytest-xdist workers for the serial tests (0: in this process)
if [ "$tier" = fast ]; then
    # the module list lives in tests/conftest.py (FAST_MODULES; there the `fast` marker comes from it)
    read -r -a modules <<< "$(python -c 'import sys; sys.path.insert(0, "tests"); import conftest; print(*conftest.FAST_MODULES)')"
    modules=("${modules[@]/#/tests/}")
    serial_limit=2400 mpi_limit=900
else
    modules=()
    serial_limit=7200 mpi_limit=1800
fi
# The serial tests on every core: most run in-process on one core, the ones that launch jobs wait on them.
stage "serial tests ($tier tier)" "$serial_limit" \
    python -m pytest -m "not mpi" -q -n "$workers" --dist loadgroup --timeout "$per_test" --durations=20 \
    ${args[@]+"${args[@]}"} ${modules[@]+"${modules[@]}"}
# Only the modules that hold MPI tests are collected under mpiexec (each rank collects them).
mpi_modules=()
for m in $(grep -l 'mark\.mpi' tests/test_*.py); do
    if [ "$tier" = full ] || [[ " ${modules[*]} " == *" $m "* ]]; then mpi_modules+=("$m"); fi
done
if [ "${#mpi_modules[@]}" -gt 0 ]; then
    for p in 1 2 3 4 5; do
        select="mpi and not big"
        [ "$p" -eq 1 ] && select="$select and not multirank"  # tests of ranks that differ need two
        stage "MPI tests at P=$p ($tier tier)" "$mpi_limit" \
            mpiexec -n "$p" python -m pytest -m "$select" --with-mpi -q -x -p no:cacheprovider --timeout "$per_test" \
            ${args[@]+"${args[@]}"} "${mpi_modules[@]}"
    done
fi
if [ "$tier" = full ]; then
    stage "large MPI test at P=2" 1800 \
        mpiexec -n 2 python -m pytest -m big --with-mpi -q -x -p no:cacheprovider --timeout "$per_test" \
        ${args[@]+"${args[@]}"} "${mpi_modules[@]}"
fi
echo "run_all.sh: the $tier tier passed in $((SECONDS - started)) s"
