#!/usr/bin/env bash
# One device call of issue 9's GPU measurements, in priority order, each part under its own
# timeout so a slow part costs only itself. Run from the repo root on the GPU machine with
# stories260K carried to carry/stories260K; results land in $OUT (default bench/results/gpu).
# PARTS picks the parts (default ABCDE, ~11 min: more than one call's 10, so run
# PARTS=ABC then PARTS=DEF on the warm machine; F, tree_cost=measured, G, the per-stage
# host time of a step, and H, learned heads through the torch backend, are not in the
# default; R, the real SmolLM2 GGUF in fp16 (~250 s), needs bench/gguf_gpu_parts.sh first,
# as do Q (the same in fp32, ~200 s), N (auto without its host-time floor, ~150 s), S (a
# step's stages, the graphs captured mid-generation and cProfile on that GGUF, ~120 s) and W
# (S's table with the old 256-row attention buckets, ~100 s). With
# 15 minutes of device time a lease: take 0, then take 1 && PARTS=RI (fp16 identity, plain
# and padded to 64 rows), then PARTS=SW, then N; I, every step padded to 64 rows, ~220 s);
# budgets (seconds): A, B, C, D, F, G. The onnxruntime CUDA EP is measured apart
# (bench/ort_gpu_parts.sh carries onnxruntime-gpu; bench/bench_ort_gpu.py measures it).
set -u
OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 EDGEMTP_LATENCY_CACHE=0
S=carry/stories260K
PARTS=${PARTS:-ABCDE}
has() { [[ $PARTS == *$1* ]]; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch,transformers;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__)"
} 2>&1 | tee "$OUT/log.txt"
# A: the target shape (135M fp16) and the real-weights model (BE, identity, auto)
has A && timeout "${A:-220}" python3 bench/bench_gpu.py --stories $S --out "$OUT" --fresh \
  --models smollm2-135m:fp16,stories260K:fp32 --prompts 12 --skip static 2>&1 | tee -a "$OUT/log.txt"
# B: the larger shapes (three drafters, two budgets: device time) and fp16 stories
has B && timeout "${B:-180}" python3 bench/bench_gpu.py --stories $S --out "$OUT" \
  --models stories260K:fp16,qwen3-0.6b:fp16,llama3.2-1b:fp16 --prompts 12 --skip static \
  --drafters probe,auto,hybrid --bc 10,60 --hf-prompts 2 2>&1 | tee -a "$OUT/log.txt"
# C: transformers' static cache + torch.compile on the 135M shape (its compile may run long)
mkdir -p "$OUT/static"
has C && timeout "${C:-100}" python3 bench/bench_gpu.py --stories $S --out "$OUT/static" --fresh \
  --models smollm2-135m:fp16 --skip t_ms,drafters,eager 2>&1 | tee -a "$OUT/log.txt"
# D: every step padded to one shape (batch-invariant fp16), the shapes that diverged most
mkdir -p "$OUT/inv"
has D && timeout "${D:-120}" python3 bench/bench_gpu.py --stories $S --out "$OUT/inv" --fresh \
  --models smollm2-135m:fp16,llama3.2-1b:fp16 --skip eager,static --drafters probe,hybrid,auto \
  --bc 10,60 --batch-invariant --warmup 2 --repeats 10 2>&1 | tee -a "$OUT/log.txt"
# F: trees that grow only while a node pays for its measured share of a step (tree_cost)
mkdir -p "$OUT/cost"
has F && timeout "${F:-120}" python3 bench/bench_gpu.py --stories $S --out "$OUT/cost" --fresh \
  --models stories260K:fp32,smollm2-135m:fp16 --prompts 12 --skip eager,static \
  --drafters hybrid,stand,auto --tree-cost measured 2>&1 | tee -a "$OUT/log.txt"
# G: where a step's time goes, per drafter (the engine's stage timers; cProfile of two)
has G && timeout "${G:-90}" python3 bench/bench_step_host.py $S --backend torch --device cuda \
  --drafters none,probe,pld,stand,hybrid,auto --bc 10,60 --tree-cost measured \
  --profile hybrid@10,stand@10 --out "$OUT/step_host.json" 2>&1 | tee "$OUT/step_host.md"
# G, same machine: the trees grown in Python (EDGEMTP_NATIVE=0) against C (above)
has G && EDGEMTP_NATIVE=0 timeout "${G2:-50}" python3 bench/bench_step_host.py $S --backend torch \
  --device cuda --drafters stand,hybrid,auto --bc 10,60 --tree-cost measured \
  --out "$OUT/step_host_python.json" 2>&1 | tee "$OUT/step_host_python.md"
# H: learned heads on the GPU (the torch backend on a package runs its source model with the
# package's heads): export with hidden states and train residual heads on the CPU, then time
HP=${HP:-/tmp/stories-heads}
has H && { timeout 60 python3 bench/edgemtp_tree.py export $S -o $HP --hidden-states --quiet \
    --force
  timeout 150 python3 bench/edgemtp_tree.py train-heads $HP --kind residual --quiet
  timeout 60 python3 bench/bench_step_host.py $HP --backend torch --device cuda \
    --drafters none,heads,auto --bc 10,30 --out "$OUT/step_host_heads.json"
} 2>&1 | tee "$OUT/heads.md"
# R: real weights, SmolLM2-135M-Instruct from the shared GGUF (carried in two parts by
# bench/gguf_gpu_parts.sh, with the gguf wheel in /tmp/site) on Spec-Bench's chat prompts:
# real BE, paired speed-ups, fp16 and fp32 identity, auto's state. ~400 s in all
GGUF=${GGUF:-/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}
RD=${RD:-auto,pld,stand,hybrid,probe,lade}
mkdir -p "$OUT/real"
has R && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${R:-250}" python3 \
  bench/bench_gpu.py --gguf "$GGUF" --models smollm2-gguf:fp16 --prompts 13 --drafters "$RD" \
  --bc 10,60 --paired 2 --warmup 2 --hf-prompts 4 --skip static --out "$OUT/real" --fresh \
  2>&1 | grep -v "it/s" | tee -a "$OUT/log.txt"
# Q: the same in fp32 (identity against plain decoding must be 13/13 per drafter there)
has Q && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${R2:-200}" python3 \
  bench/bench_gpu.py --gguf "$GGUF" --models smollm2-gguf:fp32 --prompts 13 --drafters "$RD" \
  --bc 10,60 --paired 1 --warmup 2 --skip static,eager --out "$OUT/real" \
  2>&1 | grep -v "it/s" | tee -a "$OUT/log.txt"
# S: where a real-weights step's time goes (the engine's stage timers, and cProfile of
# hybrid@60: the H100 showed ~1.6 ms a step beyond its forward there); needs R's GGUF parts,
# its own call (R alone is near a call's 600 s). pld and stand beside them: on the H100 pld
# and LADE ran within ~0.1 ms a step of what bench/emulate_gpu.py charges them, STAND +0.25
# ms, auto +0.2, the hybrid +0.6-1.2 (bench/results/emulated_h100_smollm2.md); and t(T) with
# a top-16, which t_ms leaves out and every drafter reading candidates pays
has S && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${S4:-120}" python3 \
  bench/bench_step_host.py "$GGUF" --backend torch --device cuda --dtype fp16 \
  --drafters none,pld,stand,hybrid,auto --bc 60 --prompts 8 --profile hybrid@60,stand@60 \
  --topk-curve 16 \
  --out "$OUT/real/step_host_gguf.json" 2>&1 | grep -v "it/s" | tee "$OUT/real/step_host_gguf.md"
# W: S's step table again with the attention span the torch backend had until 2026-11-29
# (EDGEMTP_ATTENTION_SPAN=256: 256-row buckets, so every block size is met again, an eager
# run and a capture, whenever the cache enters a new bucket; S runs the default, spans that
# double from 1024 rows: bench/results/emulated_h100_smollm2_spans.md); set beside S's rows
has W && EDGEMTP_ATTENTION_SPAN=256 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
  timeout "${W4:-100}" python3 \
  bench/bench_step_host.py "$GGUF" --backend torch --device cuda --dtype fp16 \
  --drafters none,pld,stand,hybrid,auto --bc 60 --prompts 8 \
  --out "$OUT/real/step_host_gguf_span256.json" 2>&1 | grep -v "it/s" \
  | tee "$OUT/real/step_host_gguf_span256.md"
# N: auto without its host-time floor (AutoDrafter.host_floor), paired with plain decoding
# in the same process, beside part R's auto rows (the floor hypothesis, README)
has N && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${R3:-150}" python3 \
  bench/bench_gpu.py --gguf "$GGUF" --models smollm2-gguf:fp16 --prompts 13 --drafters auto,pld \
  --bc 10,60 --paired 2 --warmup 2 --skip static,eager --auto-param host_floor=0 \
  --out "$OUT/real_nofloor" --fresh 2>&1 | grep -v "it/s" | tee -a "$OUT/log.txt"
# I: the real GGUF in fp16 with every step padded to 64 rows (batch-invariant): identity
# against plain decoding padded the same way, where issue 9's fp16 target (>= 99 %) is still
# unmeasured on real weights (R's unpadded fp16: 145/156, every divergence a near-tie), and
# what the padding costs plain decoding (its tok/s beside R's); needs R's GGUF parts, ~220 s
mkdir -p "$OUT/real_inv"
has I && PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${I4:-230}" python3 \
  bench/bench_gpu.py --gguf "$GGUF" --models smollm2-gguf:fp16 --prompts 13 --drafters "$RD" \
  --bc 10,60 --paired 1 --warmup 1 --skip static,eager --batch-invariant \
  --out "$OUT/real_inv" --fresh 2>&1 | grep -v "it/s" | tee -a "$OUT/log.txt"
# E: the command line from the tree: doctor, and generate on the GPU
has E && { timeout 30 python3 bench/edgemtp_tree.py doctor
  timeout 30 python3 bench/edgemtp_tree.py generate --model $S --backend torch --device cuda \
    --dtype fp16 --prompt "Once upon a time" --max-new-tokens 64
} 2>&1 | tee -a "$OUT/log.txt"
ls -la "$OUT" "$OUT/static" "$OUT/inv" "$OUT/cost" "$OUT/real" "$OUT/real_nofloor" \
  "$OUT/real_inv"
