#!/usr/bin/env bash
# Carry onnxruntime-gpu's wheel (255 MB, a CUDA 13 build) to a lent GPU machine in parts: a
# device call takes at most 64 MiB of working tree, and /tmp there survives between calls
# made back to back (the machine goes back after 30 s idle).
#   here:   bash bench/ort_gpu_parts.sh split      # .whl/<wheel>, carry/ortgpu/p0 .. p5
#   there:  one call per part, back to back:
#             run(carry=["carry/ortgpu/pN"], command="bash bench/ort_gpu_parts.sh take N")
#           then, in the same warm machine:
#             bash bench/ort_gpu_parts.sh install && python3 bench/bench_ort_gpu.py ... \
#               --site /tmp/site --out $OUT
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
  *) echo "usage: $0 split | take N | install" >&2; exit 2;;
esac
