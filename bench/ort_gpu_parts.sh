#!/usr/bin/env bash
# Carry onnxruntime-gpu's wheel (255 MB, a CUDA 13 build) to a lent GPU machine in parts: a
# device call takes at most 64 MiB of working tree, and /tmp there survives between calls
# made back to back (the machine goes back after 30 s idle).
#   here:   bash bench/ort_gpu_parts.sh split      # .whl/<wheel>, carry/ortgpu/p0 .. p4
#           bash bench/ort_gpu_parts.sh prep       # carry/stories260K, carry/pkgs/stories-*
#   there:  one call per part, back to back:
#             run(carry=["carry/ortgpu/pN"], command="bash bench/ort_gpu_parts.sh take N")
#           then, in the same warm machine (the last part's call can do it, carrying
#           carry/pkgs too):
#             bash bench/ort_gpu_parts.sh install && bash bench/ort_gpu_parts.sh bench
#   (2026-11-26, H200: five take calls ~6 s each after a ~30 s start; the bench ~2 min)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.31.1
WHEEL=onnxruntime_gpu-$VERSION-cp312-cp312-manylinux_2_28_x86_64.whl
case "${1:-}" in
  split)
    mkdir -p .whl
    [ -f .whl/$WHEEL ] || python3 -m pip download --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      -d .whl onnxruntime-gpu==$VERSION
    rm -rf carry/ortgpu && mkdir -p carry/ortgpu
    split -n 5 -d -a 1 .whl/$WHEEL carry/ortgpu/part.
    sum=$(sha256sum .whl/$WHEEL | cut -d' ' -f1)
    for f in carry/ortgpu/part.*; do
      n=${f##*.}; mkdir -p carry/ortgpu/p$n; mv "$f" carry/ortgpu/p$n/part
      echo "$sum" > carry/ortgpu/p$n/sha256
    done
    ls carry/ortgpu;;
  take)
    n=${2:?take N}; mkdir -p /tmp/ortgpu
    cp carry/ortgpu/p$n/part /tmp/ortgpu/part.$n
    cp carry/ortgpu/p$n/sha256 /tmp/ortgpu/sha256
    ls -la /tmp/ortgpu;;
  install)
    cat /tmp/ortgpu/part.? > /tmp/ortgpu/$WHEEL
    echo "$(cat /tmp/ortgpu/sha256)  /tmp/ortgpu/$WHEEL" | sha256sum -c -
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/ortgpu/$WHEEL
    PYTHONPATH=/tmp/site python3 -c "import onnxruntime as o; o.preload_dlls(); \
print(o.__version__, o.get_available_providers())";;
  prep)
    # the real-weights packages the bench runs (exported here: the GPU host's onnxruntime
    # 1.30 could not run the self-check before the empty-past fix) and the model folder
    S=${SHARED:-../shared}/models/stories260K
    rm -rf carry/stories260K && mkdir -p carry/pkgs && cp -r "$S" carry/stories260K
    for d in fp32 fp16; do
      "${EDGEMTP:-.venv/bin/edgemtp}" export "$S" --out carry/pkgs/stories-$d --dtype $d --force
    done
    du -sh carry/pkgs/* carry/stories260K;;
  bench)
    # stories260K (real weights: BE, identity) and the 135M shape (random weights, exported
    # there: t(T) and tok/s) with CUDA graphs asked for (DEVICES=cuda-nographs,cuda to compare;
    # uncaptured was measured on an H200, ort_gpu_h200.md). Packages exported since
    # 2026-11-26 hold no shape node once the past's rows are fixed: does the EP capture now?
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 EDGEMTP_LATENCY_CACHE=0
    OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
    timeout "${BUDGET:-400}" python3 bench/bench_ort_gpu.py carry/pkgs/stories-fp32 \
      --export smollm2-135m:fp16 --site /tmp/site \
      --devices "${DEVICES:-cuda}" --drafters auto,probe,pld,hybrid --bc 10,60 --prompts 12 \
      --new-tokens 128 --repeats 20 --out "$OUT" > "$OUT/ort_log.txt" 2>&1
    echo "rc=$?"; grep -v '^|' "$OUT/ort_log.txt" | tail -20;;
  *) echo "usage: $0 split | prep | take N | install | bench" >&2; exit 2;;
esac
