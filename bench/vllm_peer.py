"""Runs the vLLM CPU peer on given prompt token ids, for bench/engine_throughput.py.

It runs under the peer's own Python (../shared/peers/vllm_cpu.sh setup), which has vLLM and none
of this project, so it imports nothing from here:

    <peer python> bench/vllm_peer.py MODEL_DIR REQUESTS_JSON RESULT_JSON

REQUESTS_JSON holds {"prompts": [[token ids], ...], "output_tokens": N}; RESULT_JSON gets
{"elapsed": seconds for the timed generate, "outputs": [[token ids], ...]} in request order.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams

# vLLM spawns its engine process, which re-imports __main__: the work stays under the guard.
if __name__ == "__main__":
    model, requests_path, result_path = sys.argv[1:4]
    with open(requests_path) as f:
        requests = json.load(f)
    # The settings of ../shared/peers/vllm_cpu.sh: bf16 in vLLM's compiled mode gave wrong greedy
    # text on this CPU, hence eager. The random prompts share no prefix, so caching is moot.
    llm = LLM(model=model, max_model_len=4096, dtype="bfloat16", enforce_eager=True,
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
        json.dump({"elapsed": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs]}, f)
