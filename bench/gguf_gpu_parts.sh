#!/usr/bin/env bash
# Carry the shared SmolLM2-135M-Instruct GGUF (98 MB) and the `gguf` wheel (transformers'
# GGUF loader needs it; the lent GPU machine lacks it) to a lent GPU machine in two parts: a
# device call takes at most 64 MiB of working tree, and /tmp there survives between calls
# made back to back (the machine goes back after 30 s idle).
#   here:   bash bench/gguf_gpu_parts.sh split     # carry/gguf/p0, carry/gguf/p1, carry/whl
#   there:  run(carry=["carry/gguf/p0"], command="bash bench/gguf_gpu_parts.sh take 0")
#           run(carry=["carry/gguf/p1", "carry/whl"],
#               command="bash bench/gguf_gpu_parts.sh take 1 && PARTS=S bash bench/gpu_session.sh")
#           then PARTS=R (fp16, ~250 s), Q (fp32), N (auto without its host floor): see
#           bench/gpu_session.sh
#   (2026-11-28, H100: the first call 0.3 s after a ~35 s start; part R's fp16 run 226 s)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    G=${SHARED:-../shared}/models/SmolLM2-135M-Instruct-GGUF/$NAME
    [ -f "$G" ] || { echo "no $G (the shared SmolLM2 GGUF)" >&2; exit 2; }
    rm -rf carry/gguf carry/whl && mkdir -p carry/gguf/p0 carry/gguf/p1 carry/whl
    split -n 2 -d -a 1 "$G" carry/gguf/part.
    mv carry/gguf/part.0 carry/gguf/p0/part && mv carry/gguf/part.1 carry/gguf/p1/part
    sha256sum "$G" | cut -d' ' -f1 > carry/gguf/p1/sha256
    V=$("${PYTHON:-.venv/bin/python}" -c "import importlib.metadata as m; print(m.version('gguf'))")
    python3 -m pip download -q --no-deps --only-binary=:all: -d carry/whl "gguf==$V"
    du -sh carry/gguf/* carry/whl;;
  take)
    n=${2:?take N}; mkdir -p /tmp/gguf
    cp carry/gguf/p$n/part /tmp/gguf/part.$n
    if [ "$n" = 1 ]; then
      cat /tmp/gguf/part.0 /tmp/gguf/part.1 > /tmp/gguf/$NAME
      echo "$(cat carry/gguf/p1/sha256)  /tmp/gguf/$NAME" | sha256sum -c -
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        carry/whl/*.whl
    fi
    ls -la /tmp/gguf;;
  *) echo "usage: $0 split | take 0 | take 1" >&2; exit 2;;
esac
