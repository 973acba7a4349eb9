"""What batch-invariant mode costs, and what it buys.

On the workload of bench/engine_throughput.py (64 requests, prompts of 128 to 512 random token
ids, 128 greedy output tokens, EOS ignored), in one run, for the mode off and on:

* throughput: every request submitted at once (continuous batching, chunked prefill);
* divergence: each request again, alone, and a count of requests whose greedy output differs
  between the solo run and the batched one.

The last line is one JSON object: ``throughput_ratio`` (on / off), ``divergent_off``,
``divergent_on`` and the figures behind them.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.batch_invariance
    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.batch_invariance \\
        --num-requests 16 --output-tokens 32            # a quick run
"""

import argparse
import json
import time

import torch

from bench import cpu
from bench.engine_throughput import add_workload_args, random_prompts, run_engine
from engine import EngineConfig, LLMEngine, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    return p.parse_args()


def solo_outputs(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def measure(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> dict:
    batched = run_engine(engine, prompts, output_tokens)
    t = time.perf_counter()
    solo = solo_outputs(engine, prompts, output_tokens)
    solo_seconds = time.perf_counter() - t
    divergent = sum(a != b for a, b in zip(batched["outputs"], solo, strict=True))
    out_tok_s = batched["out_tokens"] / batched["elapsed"]
    label = "on " if engine.config.batch_invariant else "off"
    print(f"batch_invariant {label}: {out_tok_s:6.1f} output tok/s batched "
          f"({batched['elapsed']:.1f} s, {batched['steps']} steps); solo runs {solo_seconds:.0f} s; "
          f"{divergent} of {len(prompts)} greedy outputs differ solo vs batched", flush=True)
    return {"out_tok_s": out_tok_s, "divergent": divergent}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_config(EngineConfig())
    prompts = random_prompts(args.num_requests, args.min_prompt, args.max_prompt,
                             engine.model_runner.vocab_size, args.seed)
    print(f"{len(prompts)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"{args.output_tokens} output tokens, {args.threads} threads", flush=True)
    off = measure(engine, prompts, args.output_tokens)
    del engine  # its KV cache: one engine's worth of memory at a time
    on = measure(LLMEngine.from_config(EngineConfig(batch_invariant=True)), prompts,
                 args.output_tokens)
    ratio = on["out_tok_s"] / off["out_tok_s"]
    print(f"throughput on/off: {ratio:.3f} (default on from 0.95); divergent greedy outputs: "
          f"off {off['divergent']}, on {on['divergent']} (target 0)")
    print(json.dumps({
        "throughput_ratio": round(ratio, 3),
        "divergent_off": off["divergent"],
        "divergent_on": on["divergent"],
        "out_tok_s_off": round(off["out_tok_s"], 1),
        "out_tok_s_on": round(on["out_tok_s"], 1),
        "num_requests": len(prompts),
        "output_tokens": args.output_tokens,
        "cpu": cpu.describe(),
    }))


if __name__ == "__main__":
    main()
