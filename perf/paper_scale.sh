#!/usr/bin/env bash
# Where the GIFT paper's -67% (input-side / Euclidean RelL2 0.33 on its wire) could come from, at
# the scale a CPU cannot reach: a ~85M-parameter Llama (studies.workloads.llama "paper-gpu": 12
# blocks of width 768, SwiGLU 2048, 1,024-token sequences) trained on one CUDA GPU with AdamW and
# with Muon (the paper's optimizer), 32 sequences (32k tokens) a step, captured after 100 and 300
# steps with 256 sequences per captured gradient (262k tokens: 8x the CPU sweep's largest, 1/4 to
# 1/8 of the paper's 1-2M), split into 16 shards of 16k tokens; then the down projections' ratio
# against tokens per gradient (paper_gain --kind mlp.down: the shards' scan from 16k to 262k
# tokens, both optimizers and phases) and Table I/II of the Muon capture after 300 steps.
#
# Not run yet (docs/method.md section 11, "Where the paper's -67% comes from"). Budget: about 12
# minutes on one H100 (training 2 x 300 steps, fp32; the analysis on the host CPU). Needs torch
# with CUDA, ~30 GiB of host memory and ~25 GB of disk under $CAP (each capture holds 16 x 85M
# float32).
# Outputs (Markdown/JSON/PNG) go to $OUT (default perf/results/paper-scale-<date>/).
set -eu
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
OUT="${OUT:-perf/results/paper-scale-$(date +%F)}"
CAP="${CAP:-/tmp/paper-scale}"
mkdir -p "$OUT" "$CAP"
for OPT in adamw muon; do
  timeout 300 "$PY" -m studies.gradients --config paper-gpu --device cuda --optimizer "$OPT" \
    --capture-at 100,300 --capture-steps 1 --ranks 16 --batch 32 --capture-batch 256 --kfac-rows 1024 \
    --out "$CAP/paper-gpu-$OPT.npz" 2>&1 | tail -n 5 | tee -a "$OUT/log.txt"
done
timeout 300 "$PY" -m studies.paper_gain "$CAP"/paper-gpu-{adamw,muon}-step{100,300}.npz --kind mlp.down \
  --wires e5m2/tensor,e4m3/256 --out "$OUT/paper-gain-down.md" | tee -a "$OUT/log.txt"
timeout 240 "$PY" -m studies.paper_tables "$CAP/paper-gpu-muon-step300.npz" --wires e5m2/tensor \
  --json "$OUT/paper-tables-muon-step300.json" > "$OUT/paper-tables-muon-step300.txt"
echo "done: $OUT"
