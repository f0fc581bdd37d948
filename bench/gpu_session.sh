#!/usr/bin/env bash
# One device call of issue 9's GPU measurements, in priority order, each part under its own
# timeout so a slow part costs only itself. Run from the repo root on the GPU machine with
# stories260K carried to carry/stories260K; results land in $OUT (default bench/results/gpu).
# Budgets (seconds) can be set with A, B, C.
set -u
OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 EDGEMTP_LATENCY_CACHE=0
S=carry/stories260K
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch,transformers;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__)"
} 2>&1 | tee "$OUT/log_a.txt"
# A: the target shape (135M fp16) and the real-weights model (BE, identity, auto)
timeout "${A:-220}" python3 bench/bench_gpu.py --stories $S --out "$OUT" --fresh \
  --models smollm2-135m:fp16,stories260K:fp32 --prompts 12 --skip static 2>&1 | tee -a "$OUT/log_a.txt"
# B: the larger shapes and fp16 stories
timeout "${B:-120}" python3 bench/bench_gpu.py --stories $S --out "$OUT" \
  --models stories260K:fp16,qwen3-0.6b:fp16,llama3.2-1b:fp16 --prompts 12 --skip static \
  2>&1 | tee "$OUT/log_b.txt"
# C: transformers' static cache + torch.compile on the 135M shape (its compile may run long)
mkdir -p "$OUT/static"
timeout "${C:-100}" python3 bench/bench_gpu.py --stories $S --out "$OUT/static" --fresh \
  --models smollm2-135m:fp16 --skip t_ms,drafters,eager 2>&1 | tee "$OUT/log_c.txt"
ls -la "$OUT" "$OUT/static"
