#!/usr/bin/env bash
# Compile every CUDA source of giftcomm with nvcc -ptx and -cubin (ptxas: registers, spills) for sm_80 (portable FP8 conversion) and
# sm_90 (Hopper: cvt.rn.satfinite.e4m3x2/e5m2x2), with the flags the run-time loader gives NVRTC.
# Sources: giftcomm/cuda/kernels/*.cu (shipped as package data, loaded by giftcomm/cuda/_loader.py)
# and any native/*.cu. Also compiles the exact text the loader hands NVRTC (headers inlined, with
# #line directives), when Python can import giftcomm.
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
sources=("$KDIR"/*.cu native/*.cu)
if [ "${#sources[@]}" -eq 0 ]; then echo "check_cuda.sh: no .cu sources found"; exit 1; fi
# the loader's own text (what NVRTC compiles at run time)
if python3 -c "import giftcomm.cuda._loader" 2>/dev/null; then
    for name in $(python3 -m giftcomm.cuda._loader --list); do
        python3 -m giftcomm.cuda._loader --dump "$name" > "$OUTDIR/loader_$name.cu" && sources+=("$OUTDIR/loader_$name.cu")
    done
else
    echo "check_cuda.sh: giftcomm not importable; skipping the loader-text compile"
fi
"$NVCC" --version | tail -1
fail=0
for src in "${sources[@]}"; do
    for arch in 80 90; do
        log="$OUTDIR/log"
        if "$NVCC" -ptx "${FLAGS[@]}" -arch=sm_$arch -I"$KDIR" -Inative "$src" -o "$OUTDIR/out.ptx" >"$log" 2>&1 &&
           "$NVCC" -cubin "${FLAGS[@]}" -arch=sm_$arch -I"$KDIR" -Inative "$src" -o "$OUTDIR/out.cubin" >>"$log" 2>&1; then
            nk=$(grep -c '^.visible .entry' "$OUTDIR/out.ptx")
            spills=$(grep -E 'bytes spill stores' "$log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads' || true)
            stack=$(grep -E 'bytes stack frame' "$log" | grep -vc '^ *0 bytes stack frame' || true)
            fp8=$(grep -c 'cvt.rn.satfinite.e[45]m[23]x2.f32' "$OUTDIR/out.ptx" || true)
            regs=$(grep -oE 'Used [0-9]+ registers' "$log" | awk '{print $2}' | sort -n | tail -1)
            echo "ok    sm_$arch  $src  ($nk kernels, max ${regs:-?} registers, $spills with spills, $stack with stack frames, $fp8 hardware FP8 cvt)"
            if grep -q 'fma.rn.f32' "$OUTDIR/out.ptx"; then echo "FAIL  sm_$arch  $src: fused multiply-add in the PTX"; fail=1; fi
            if [ "$arch" = 90 ] && [ "$fp8" -eq 0 ] && grep -q gc_e4m3 "$src"; then echo "FAIL  sm_90  $src: no hardware FP8 conversion"; fail=1; fi
            # CuPy compiles with -ftz=true whatever the loader asks: no instruction may flush then either
            if "$NVCC" -ptx -std=c++17 -ftz=true -arch=sm_$arch -I"$KDIR" -Inative "$src" -o "$OUTDIR/ftz.ptx" >/dev/null 2>&1 &&
               grep -qE '^\s*[a-z0-9_]+(\.[a-z0-9_]+)*\.ftz' "$OUTDIR/ftz.ptx"; then
                echo "FAIL  sm_$arch  $src: flush-to-zero instructions under -ftz=true"; fail=1
            fi
        else
            echo "FAIL  sm_$arch  $src"; cat "$log"; fail=1
        fi
    done
done
exit $fail
