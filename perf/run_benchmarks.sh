#!/usr/bin/env bash
# Re-runs the benchmarks quoted in docs/performance.md and writes their outputs under
# perf/results/ (each file starts with the command that produced it). Needs root for the netbed
# sweeps. About 15 minutes on the 2-core development VM. Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
R=perf/results
run() {  # run OUTFILE CMD...: print and record the command, then its output
    local out=$1; shift
    { echo "# \$ $*"; echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"; echo; } > "$out"
    echo "+ $*" >&2
    "$@" 2>/dev/null | tee -a "$out"
}
run $R/codec.txt python -m giftcomm.perf codec
for p in 2 4; do
    # More ranks than cores: let MPICH yield while it waits, as perf/netbed does (every row
    # alike, the MPI_Allreduce baseline included; the header of the output lists the settings).
    yield_env=()
    if [ "$p" -gt "$(nproc)" ]; then
        yield_env=(env MPIR_CVAR_ENABLE_HEAVY_YIELD=1 MPIR_CVAR_POLLS_BEFORE_YIELD=1)
    fi
    run $R/shm-window-p$p-run1.txt "${yield_env[@]}" mpiexec -n $p python -m giftcomm.perf allreduce -b 64K -e 256M -f 2 \
        --fmt e4m3,bf16,fp32 -n 10 -w 2 --no-progress --json $R/shm-window-p$p.json --label "shared memory P=$p"
done
for rate in 1gbit 10gbit; do
    run $R/netbed-$rate-p4.txt perf/netbed run --hosts 4 --rate $rate --timeout 900 -- \
        python -m giftcomm.perf allreduce -b 16M -e 256M -f 2 --fmt e4m3,bf16,fp32 -n 3 -w 1 \
        --no-progress --json $R/netbed-$rate-p4.json --label "netbed $rate"
done
python -m studies plot $R/shm-window-p2.json $R/shm-window-p4.json $R/netbed-1gbit-p4.json $R/netbed-10gbit-p4.json \
    -o docs/busbw.png
