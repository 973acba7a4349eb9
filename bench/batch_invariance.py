"""What batch-invariant mode costs, and what it buys.

On the workload of bench/engine_throughput.py (64 requests, prompts of 128 to 512 random token
ids, 128 greedy output tokens, EOS ignored), in one run, for the mode off and on:

* throughput: every request submitted at once (continuous batching, chunked prefill);
* divergence: each request again, alone, and a count of requests whose greedy output differs
  between the solo run and the batched one.

Throughput runs ``--rounds`` times per mode, alternated (off, on, off, ...), and each mode's
best round is compared: the first run of a mode also pays for what the matmul libraries build
per shape, which a serving engine pays once. The last line is one JSON object:
``throughput_ratio`` (on / off), ``divergent_off``, ``divergent_on`` and the figures behind them.

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
    p.add_argument("--rounds", type=int, default=2,
                   help="batched runs of each mode, alternated; the best of each is reported")
    return p.parse_args()


def solo_outputs(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def label(engine: LLMEngine) -> str:
    return "on " if engine.config.batch_invariant else "off"


def batched_round(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> dict:
    batched = run_engine(engine, prompts, output_tokens)
    batched["out_tok_s"] = batched["out_tokens"] / batched["elapsed"]
    print(f"batch_invariant {label(engine)}: {batched['out_tok_s']:6.1f} output tok/s batched "
          f"({batched['elapsed']:.1f} s, {batched['steps']} steps)", flush=True)
    return batched


def divergent(engine: LLMEngine, prompts: list[list[int]], output_tokens: int,
              batched: list) -> int:
    t = time.perf_counter()
    solo = solo_outputs(engine, prompts, output_tokens)
    count = sum(a != b for a, b in zip(batched, solo, strict=True))
    print(f"batch_invariant {label(engine)}: solo runs {time.perf_counter() - t:.0f} s; "
          f"{count} of {len(prompts)} greedy outputs differ solo vs batched", flush=True)
    return count


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Both engines stay loaded, so their rounds alternate (two KV caches: ~2 GB each here).
    engines = [LLMEngine.from_config(EngineConfig(batch_invariant=mode)) for mode in (False, True)]
    prompts = random_prompts(args.num_requests, args.min_prompt, args.max_prompt,
                             engines[0].model_runner.vocab_size, args.seed)
    print(f"{len(prompts)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
          f"{args.output_tokens} output tokens, {args.threads} threads, {args.rounds} rounds",
          flush=True)
    rounds: list[list[dict]] = [[], []]
    for _ in range(args.rounds):
        for engine, runs in zip(engines, rounds, strict=True):
            runs.append(batched_round(engine, prompts, args.output_tokens))
    off, on = (max(runs, key=lambda run: run["out_tok_s"]) for runs in rounds)
    divergent_off, divergent_on = (
        divergent(engine, prompts, args.output_tokens, best["outputs"])
        for engine, best in zip(engines, (off, on), strict=True)
    )
    ratio = on["out_tok_s"] / off["out_tok_s"]
    print(f"throughput on/off, best of {args.rounds}: {ratio:.3f} (default on from 0.95); "
          f"divergent greedy outputs: off {divergent_off}, on {divergent_on} (target 0)")
    print(json.dumps({
        "throughput_ratio": round(ratio, 3),
        "divergent_off": divergent_off,
        "divergent_on": divergent_on,
        "out_tok_s_off": round(off["out_tok_s"], 1),
        "out_tok_s_on": round(on["out_tok_s"], 1),
        "rounds_out_tok_s_off": [round(run["out_tok_s"], 1) for run in rounds[0]],
        "rounds_out_tok_s_on": [round(run["out_tok_s"], 1) for run in rounds[1]],
        "num_requests": len(prompts),
        "output_tokens": args.output_tokens,
        "cpu": cpu.describe(),
    }))


if __name__ == "__main__":
    main()
