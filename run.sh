#!/usr/bin/env bash
# edgemtp set-up and entry points. Creates .venv on first use (torch CPU build first, so no
# CUDA wheels are pulled), then:
#   ./run.sh            the main job: greedy vs probing on the default model, text + speed-ups
#                       (./run.sh --prompts 1 ...: the main job with demo's options)
#   ./run.sh test       the test suite
#   ./run.sh bench      the BE / tokens-per-second benchmark (writes bench/results/)
#   ./run.sh ARGS...    any other arguments go to the edgemtp CLI (./run.sh generate --help)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.edgemtp-installed" ] || [ pyproject.toml -nt "$VENV/.edgemtp-installed" ]; then
  echo "run.sh: setting up $VENV (first run: PyTorch CPU, then edgemtp and its extras; 1-3 minutes)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  echo "run.sh: [1/2] torch==2.13.0 (CPU build)" >&2
  if [ "$(uname -sm)" = "Linux x86_64" ] && "$VENV/bin/python" -c \
      "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
    # PyPI's Linux x86-64 torch is the CUDA build (GBs of nvidia-* wheels): the CPU build
    # comes from PyTorch's own index (the plain pin where that index resolves but cannot be
    # reached)
    "$VENV/bin/pip" install -q "torch==2.13.0+cpu" \
      --extra-index-url https://download.pytorch.org/whl/cpu \
      || "$VENV/bin/pip" install -q "torch==2.13.0"
  else  # (macOS and Linux aarch64, whose PyPI wheels are CPU builds; a machine without that
    #    index, whose pip finds a local CPU wheel)
    if [ "$(uname -sm)" = "Linux x86_64" ] && "$VENV/bin/pip" install -q --dry-run --report \
        "$VENV/torch-plan.json" "torch==2.13.0" >/dev/null 2>&1 && "$VENV/bin/python" -c \
        "import json,sys; sys.exit(not any(i['metadata']['name'].lower().startswith('nvidia')
         for i in json.load(open(sys.argv[1]))['install']))" "$VENV/torch-plan.json"; then
      echo "run.sh: download.pytorch.org cannot be reached and pip finds only PyPI's CUDA" \
        "build of torch==2.13.0 (several GB of nvidia-* wheels; it runs on CPUs too):" \
        "installing it. For the CPU build, put its wheel where pip finds it (PIP_FIND_LINKS)" \
        "and delete $VENV first" >&2
    fi
    rm -f "$VENV/torch-plan.json"
    "$VENV/bin/pip" install -q "torch==2.13.0"
  fi
  echo "run.sh: [2/2] edgemtp[export,bench,dev,serve]" >&2
  "$VENV/bin/pip" install -q -e ".[export,bench,dev,serve]"
  touch "$VENV/.edgemtp-installed"
  echo "run.sh: done; 'source $VENV/bin/activate' puts the edgemtp command on your PATH" >&2
fi
case "${1:-demo}" in
  # two workers (both cores of the CI machine), one test file per worker at a time
  test)  shift; exec "$VENV/bin/python" -m pytest -q -n 2 --dist loadfile "$@" ;;
  bench) shift; exec "$VENV/bin/python" bench/bench_probe.py "$@" ;;
  demo)  [ $# -gt 0 ] && shift; exec "$VENV/bin/edgemtp" demo "$@" ;;
  # the CLI's own --help / --version; any other option is the main job's (./run.sh --prompts 1)
  -h|--help|--version) exec "$VENV/bin/edgemtp" "$@" ;;
  -*)    exec "$VENV/bin/edgemtp" demo "$@" ;;
  *)     exec "$VENV/bin/edgemtp" "$@" ;;
esac
