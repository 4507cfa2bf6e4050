#!/usr/bin/env bash
# Compile every CUDA source of giftcomm with nvcc -ptx and -cubin (ptxas: registers, spills) for sm_80 (portable FP8 conversion) and
# sm_90 (Hopper: cvt.rn.satfinite.e4m3x2/e5m2x2), with the flags the run-time loader gives NVRTC.
# Sources: the exact text giftcomm/cuda/_loader.py hands NVRTC for each kernel module (the files of
# giftcomm/cuda/kernels/ with their headers inlined) when Python can import giftcomm, else those
# files themselves; and any native/*.cu. The (source, architecture) pairs compile in parallel.
# Exit status: 0 when every compile succeeds or when nvcc is absent (with a message); 1 otherwise.
set -u
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
    echo "check_cuda.sh: nvcc not found; CUDA sources NOT checked (set NVCC=/path/to/nvcc)"
    exit 0
fi
FLAGS=(-std=c++17 --fmad=false --ftz=false --prec-div=true --prec-sqrt=true -Xptxas=-v -Werror=all-warnings)
KDIR=giftcomm/cuda/kernels
OUTDIR="$(mktemp -d)"
trap 'rm -rf "$OUTDIR"' EXIT
shopt -s nullglob
# What to compile: the exact text the loader hands NVRTC (each kernel module with its headers
# inlined, #line directives pointing back at the files) when Python can import giftcomm; otherwise
# the kernel files themselves. Plus any native/*.cu.
sources=()
if python3 -c "import giftcomm.cuda._loader" 2>/dev/null; then
    for name in $(python3 -m giftcomm.cuda._loader --list); do
        python3 -m giftcomm.cuda._loader --dump "$name" > "$OUTDIR/loader_$name.cu" && sources+=("$OUTDIR/loader_$name.cu")
    done
else
    echo "check_cuda.sh: giftcomm not importable; compiling the kernel files instead of the loader's text"
    sources+=("$KDIR"/*.cu)
fi
sources+=(native/*.cu)
if [ "${#sources[@]}" -eq 0 ]; then echo "check_cuda.sh: no .cu sources found"; exit 1; fi
"$NVCC" --version | tail -1

# check SRC ARCH TAG: compile to PTX, assemble that PTX to a cubin (ptxas -v: registers, spills),
# and compile once more with -ftz=true (CuPy's flag) to look for flushing instructions. Prints one
# "ok"/"FAIL" block; exit status 1 on a failure.
check() {
    local src=$1 arch=$2 out="$OUTDIR/$3"
    if "$NVCC" -ptx "${FLAGS[@]}" -arch=sm_$arch -I"$KDIR" -Inative "$src" -o "$out.ptx" >"$out.log" 2>&1 &&
       "$NVCC" -cubin "${FLAGS[@]}" -arch=sm_$arch "$out.ptx" -o "$out.cubin" >>"$out.log" 2>&1; then
        local nk spills stack fp8 regs bad=0
        nk=$(grep -c '^.visible .entry' "$out.ptx")
        spills=$(grep -E 'bytes spill stores' "$out.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads' || true)
        stack=$(grep -E 'bytes stack frame' "$out.log" | grep -vc '^ *0 bytes stack frame' || true)
        fp8=$(grep -c 'cvt.rn.satfinite.e[45]m[23]x2.f32' "$out.ptx" || true)
        regs=$(grep -oE 'Used [0-9]+ registers' "$out.log" | awk '{print $2}' | sort -n | tail -1)
        echo "ok    sm_$arch  $src  ($nk kernels, max ${regs:-?} registers, $spills with spills, $stack with stack frames, $fp8 hardware FP8 cvt)"
        if grep -q 'fma.rn.f32' "$out.ptx"; then echo "FAIL  sm_$arch  $src: fused multiply-add in the PTX"; bad=1; fi
        if [ "$arch" = 90 ] && [ "$fp8" -eq 0 ] && grep -q gc_e4m3 "$src"; then echo "FAIL  sm_90  $src: no hardware FP8 conversion"; bad=1; fi
        # CuPy compiles with -ftz=true whatever the loader asks: no instruction may flush then either
        if "$NVCC" -ptx -std=c++17 -ftz=true -arch=sm_$arch -I"$KDIR" -Inative "$src" -o "$out.ftz.ptx" >/dev/null 2>&1 &&
           grep -qE '^\s*[a-z0-9_]+(\.[a-z0-9_]+)*\.ftz' "$out.ftz.ptx"; then
            echo "FAIL  sm_$arch  $src: flush-to-zero instructions under -ftz=true"; bad=1
        fi
        return $bad
    fi
    echo "FAIL  sm_$arch  $src"; cat "$out.log"; return 1
}

# one job per (source, architecture), as many at once as there are cores; reports in order
jobs_max=$(nproc 2>/dev/null || echo 2)
pids=(); i=0
for src in "${sources[@]}"; do
    for arch in 80 90; do
        i=$((i + 1))
        while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
        check "$src" "$arch" "job$i" >"$OUTDIR/job$i.out" 2>&1 &
        pids+=("$!")
    done
done
fail=0
for k in "${!pids[@]}"; do
    wait "${pids[$k]}" || fail=1
    cat "$OUTDIR/job$((k + 1)).out"
done
exit $fail
