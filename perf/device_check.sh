#!/usr/bin/env bash
# The GPU check for a machine with one CUDA GPU: <= 8 minutes, spent on what only a GPU can show.
# CPU-only work is not repeated here (CI does it): no C build, no nvcc compile checks, no
# emulated suite. giftcomm runs from this checkout (PYTHONPATH), not installed.
#
# Expected on the machine: CuPy, torch with CUDA (JAX with CUDA optional). Installs nothing from
# a registry; when mpi4py is missing and the git-ignored folder .device-wheels/ holds wheels
# (e.g. `pip download mpich mpi4py -d .device-wheels` on a machine with the same Python), they
# are installed with --no-index --no-deps.
#
# Steps, in this order (riskiest first), each under its own timeout cut to what is left of the
# budget (BUDGET_S, default 465 s), so the whole script ends within 8 minutes:
#  1. kernels: tests/test_gpu.py (every kernel vs giftcomm.reference, edge tables, NaN/Inf); then
#     the fused GIFT transform: tests/test_fused_emulated.py on the real GPU
#     (GIFTCOMM_FUSED_ON_GPU=1: the kernels and gift_allreduce on device arrays against the host
#     model, bit for bit; the stand-in's allocation-counting test left out)
#  2. collectives: studies/device/matrix.py --sections collectives (every format x rounding x
#     algorithm, float32/float64, normal data and the subnormal probe), then the cupy path of
#     tests/test_collectives.py
#  3. DDP hook device route: results (matrix --sections ddp: bit-identical to the host path,
#     ranks identical, no host copy), then speed vs bf16_compress_hook (examples/ddp_device_check.py)
#  4. FSDP2 through giftcomm at world size 1 (tests/test_fsdp*.py -k "cuda or device", when present)
#  5. plans on device arrays (matrix --sections plans)
#  6. JAX GPU arrays (matrix --sections jax; reports "skipped" without a JAX GPU backend)
#  7. the fused GIFT targets on one Llama-like layer (python -m giftcomm.perf device --sections
#     gift), then the codec benchmark at 2^28 values (the other sections)
# A failing step is reported and the next one still runs; a step with no time left is reported as
# skipped (and fails the script). Outputs -- the summary device-check-<date>.md, every step's
# Markdown/JSON, and the log -- go to perf/results/ and are copied to $OUT after every step.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
RES=perf/results
DAY=$(date +%F)
mkdir -p "$RES"
LOG="$RES/device-check-$DAY.log"
SUM="$RES/device-check-$DAY.md"
: > "$LOG"
status=0
BUDGET_S="${BUDGET_S:-465}"
{
    echo "# perf/device_check.sh $DAY"
    echo
    echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    echo "| step | limit s | took s | exit |"
    echo "| --- | ---: | ---: | --- |"
} > "$SUM"
copy_out() {
    [ -n "${OUT:-}" ] || return 0
    cp "$SUM" "$LOG" "$OUT"/ 2>/dev/null
    cp "$RES"/device-*-"$DAY".md "$RES"/device-*-"$DAY".json "$RES"/ddp-device-check-"$DAY".json "$OUT"/ 2>/dev/null
    return 0
}
step() {  # step NAME SECONDS CMD...
    local name="$1" secs="$2"; shift 2
    local left=$((BUDGET_S - SECONDS))
    [ "$secs" -gt "$left" ] && secs=$left
    if [ "$secs" -lt 10 ]; then
        echo "=== $name: skipped, the 8-minute budget is spent ===" | tee -a "$LOG"
        echo "| $name | - | - | skipped (budget spent) |" >> "$SUM"; status=1; copy_out; return
    fi
    echo "=== $name (limit ${secs}s) ===" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$secs" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local verdict="$rc"
    [ "$rc" -eq 124 ] && verdict="124 (timed out)"
    echo "=== $name: exit $rc ===" | tee -a "$LOG"
    echo "| $name | $secs | $((SECONDS - t0)) | $verdict |" >> "$SUM"
    [ "$rc" -eq 0 ] || status=1
    copy_out
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
if ! "$PY" -c "import mpi4py" 2>/dev/null && ls .device-wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps .device-wheels/*.whl 2>&1 | tee -a "$LOG"
fi
"$PY" -c "import cupy, giftcomm.cuda as c; print('cupy', cupy.__version__, 'devices', c.device_count())" 2>&1 | tee -a "$LOG"
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider)
step "1 kernels: tests/test_gpu.py" 100 "${PYTEST[@]}" -x tests/test_gpu.py
step "1b fused GIFT transform on the GPU" 40 env GIFTCOMM_FUSED_ON_GPU=1 "${PYTEST[@]}" tests/test_fused_emulated.py \
    -k "not steady_state"
step "2a collectives matrix (subnormal probe)" 75 "$PY" -m studies.device.matrix --quick --sections collectives --out "$RES"
step "2b collectives: cupy path of tests/test_collectives.py" 40 "${PYTEST[@]}" tests/test_collectives.py -k cupy
step "3a DDP hook device route: results" 35 "$PY" -m studies.device.matrix --quick --sections ddp --out "$RES"
step "3b DDP hook device route: speed" 55 "$PY" examples/ddp_device_check.py --json "$RES/ddp-device-check-$DAY.json"
if grep -qE 'def test_[a-z0-9_]*(cuda|device)' tests/test_fsdp*.py 2>/dev/null; then
    step "4 FSDP2 at world size 1" 25 "${PYTEST[@]}" tests/test_fsdp*.py -k "cuda or device"
else
    echo "| 4 FSDP2 at world size 1 | - | - | not written (no test_*cuda* / test_*device* in tests/test_fsdp*.py) |" >> "$SUM"
    status=1
fi
step "5 plans on device" 20 "$PY" -m studies.device.matrix --sections plans --out "$RES"
step "6 JAX GPU arrays" 20 "$PY" -m studies.device.matrix --sections jax --out "$RES"
step "7a fused GIFT targets (one layer)" 45 "$PY" -m giftcomm.perf device --sections gift --reps 10 \
    --out "$RES/device-gift-$DAY.md" --json "$RES/device-gift-$DAY.json"
step "7b codec benchmark 2^28" 75 "$PY" -m giftcomm.perf device --log2n 28 --reps 10 --sections codec,torch,transform \
    --out "$RES/device-bench-$DAY.md" --json "$RES/device-bench-$DAY.json"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
{ echo; echo "overall exit $status; total ${SECONDS} s"; } >> "$SUM"
copy_out
echo "device_check.sh: overall exit $status"
exit $status
