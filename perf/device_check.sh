#!/usr/bin/env bash
# The GPU check for a machine with one CUDA GPU (sized for <= 8 minutes on one H200). Installs
# nothing from a registry: CuPy, NCCL, torch and nvcc are expected there; this repo is installed
# with pip install -e . --no-deps --no-build-isolation (builds the optional C extension).
# Writes perf/results/device-<date>.md (and copies it and the logs to $OUT when OUT is set).
# Steps: nvcc check of the .cu sources (and the -ftz=true PTX check); tests/test_gpu.py; python -m giftcomm.perf device
# (codec / torch peer / transform / gift_allreduce timings, giftcomm/perf/device_bench.py);
# the cupy path of tests/test_collectives.py; python -m studies device-check --quick (studies/device/check.py);
# examples/ddp_device_check.py.
# Each step runs under its own timeout, cut to what is left of an 8-minute budget (BUDGET_S,
# default 465 s), so the whole script ends within 8 minutes; a failing step is reported and the
# next one still runs; a step with no time left is reported as skipped (and fails the script).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
RES=perf/results
mkdir -p "$RES"
LOG="$RES/device-$(date +%F).log"
: > "$LOG"
status=0
BUDGET_S="${BUDGET_S:-465}"
step() {  # step NAME SECONDS CMD...
    local name="$1" secs="$2"; shift 2
    local left=$((BUDGET_S - SECONDS))
    [ "$secs" -gt "$left" ] && secs=$left
    if [ "$secs" -lt 10 ]; then
        echo "=== $name: skipped, the 8-minute budget is spent ===" | tee -a "$LOG"; status=1; return
    fi
    echo "=== $name (limit ${secs}s) ===" | tee -a "$LOG"
    timeout "$secs" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc ===" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
step "pip install -e ." 90 "$PY" -m pip install -q -e . --no-deps --no-build-isolation
step "nvcc check" 60 bash native/check_cuda.sh
step "nvcc -ftz=true PTX check" 60 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_plumbing.py -k "ftz or device_bench"
step "tests/test_gpu.py" 120 "$PY" -m pytest -q -x -rs -p no:cacheprovider tests/test_gpu.py
step "device benchmark" 120 "$PY" -m giftcomm.perf device --out "$RES/device-bench-$(date +%F).md" --json "$RES/device-bench-$(date +%F).json"
step "collectives on cupy" 75 "$PY" -m pytest -q -x -rs -p no:cacheprovider tests/test_collectives.py -k cupy
step "device_check" 120 "$PY" -m studies device-check --quick --out "$RES" "$@"
step "ddp hook device route" 60 "$PY" examples/ddp_device_check.py --json "$RES/ddp-device-check-$(date +%F).json"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$RES"/device-*.md "$RES"/device-bench-*.json "$LOG" "$OUT"/ 2>/dev/null; fi
echo "device_check.sh: overall exit $status"
exit $status
