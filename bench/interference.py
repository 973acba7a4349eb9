"""Prefill-decode interference: steady streaming decodes while long prompts arrive.

Workload (fixed seed, printed): D streaming requests (short prompts, 256 output tokens) start
together; L long prompts (1,500 to 3,000 tokens, a few output tokens each) arrive on a Poisson
schedule while they stream. The same workload, on the same model, runs in two modes: chunked
prefill on (vLLM V1 policy: decodes first, prefill chunks fill the token budget) and off (vLLM
V0: a waiting prompt is prefilled whole in a step of its own, stalling every decode). The modes
alternate over `--rounds` rounds (chunked first in odd rounds, unchunked first in even ones), so
load from other processes and warm-up fall on both alike.

The Poisson rate is set from a calibration: the mean gap between long prompts is the decoders'
expected lifetime divided by L + 1, so the arrivals land while they stream.

Reported per mode and round: TTFT p50/p99 of the long prompts (the requests that arrive under
load), TPOT p50/p99 over all requests, ITL p99 over all tokens, output throughput, and the phase
diagnosis. The last line is one JSON object: the chunked/unchunked ratios (median over rounds),
each round's ratios, and their spread ((max - min) / median).

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.interference
"""

import argparse
import json
import os
import random
import statistics
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams, diagnose
from engine.diagnosis import percentile
from engine.model_runner import ModelRunner


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--decoder-prompt", type=int, default=64)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-min", type=int, default=1500)
    p.add_argument("--long-max", type=int, default=3000)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=EngineConfig().max_num_batched_tokens,
                   help="token budget per step (default: the engine's)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of both modes, alternating which runs first")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None,
                   help="write every request's timeline summary here (JSON), for "
                        "engine.diagnosis.diagnose or the CLI")
    return p.parse_args()


def build_engine(checkpoint, model_runner: ModelRunner | None, chunked: bool,
                 args: argparse.Namespace) -> LLMEngine:
    budget = args.max_num_batched_tokens
    config = EngineConfig(
        model=args.model, max_model_len=args.long_max + args.long_output + 8,
        max_num_seqs=max(32, args.decoders + args.long_prompts), max_num_batched_tokens=max(
            budget, args.decoders + args.long_prompts),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=chunked, enable_prefix_caching=False, seed=args.seed,
    )
    if model_runner is None:
        model_runner = ModelRunner.from_checkpoint(checkpoint, config)
    # A fresh scheduler and block manager on the same weights and cache.
    return LLMEngine(config, model_runner, checkpoint.tokenizer, model_id=checkpoint.model_id)


def make_workload(args: argparse.Namespace, vocab: int, mean_gap: float) -> list[tuple]:
    """(arrival offset in seconds, kind, prompt ids, params), sorted by arrival."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    stream = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True)
    work = [(0.0, "decoder", prompt(args.decoder_prompt), stream) for _ in range(args.decoders)]
    at = 0.0
    for _ in range(args.long_prompts):
        at += rng.expovariate(1.0 / mean_gap)
        work.append((at, "long", prompt(rng.randint(args.long_min, args.long_max)), long))
    return sorted(work, key=lambda w: w[0])


def run(engine: LLMEngine, workload: list[tuple]) -> dict:
    """Feed the workload on its schedule; the finished requests' summaries and the makespan."""
    pending = list(workload)
    kinds: dict[str, str] = {}
    finished: list[dict] = []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, kind, prompt, params = pending.pop(0)
            kinds[engine.add_request(prompt, params, arrival=start + at)] = kind
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            if out.finished:
                finished.append(out.metrics.to_dict() | {"kind": kinds[out.request_id]})
    makespan = time.perf_counter() - start
    return {"summaries": finished, "makespan": makespan,
            "out_tokens": sum(s["num_output_tokens"] for s in finished)}


def report(name: str, result: dict) -> dict:
    summaries = result["summaries"]
    long = [s for s in summaries if s["kind"] == "long"]
    decoders = [s for s in summaries if s["kind"] == "decoder"]
    tpots = [s["tpot"] for s in summaries if s["tpot"] is not None]
    itl = [gap for s in summaries for gap in s["itl"]]
    stats = {
        "ttft_p50": percentile([s["ttft"] for s in long], 50),
        "ttft_p99": percentile([s["ttft"] for s in long], 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "decoder_tpot_p99": percentile([s["tpot"] for s in decoders], 99),
        "itl_p99": percentile(itl, 99),
        "itl_max": max(itl),
        "throughput": result["out_tokens"] / result["makespan"],
    }
    print(f"\n== {name}: makespan {result['makespan']:.1f} s, {result['out_tokens']} output "
          f"tokens, {stats['throughput']:.1f} output tok/s (load average after: "
          f"{os.getloadavg()[0]:.1f})")
    print(f"   long-prompt TTFT p50 {stats['ttft_p50']:.2f} s, p99 {stats['ttft_p99']:.2f} s")
    print(f"   TPOT p50 {stats['tpot_p50'] * 1e3:.0f} ms, p99 {stats['tpot_p99'] * 1e3:.0f} ms "
          f"(streaming decoders' p99 {stats['decoder_tpot_p99'] * 1e3:.0f} ms); ITL p99 "
          f"{stats['itl_p99'] * 1e3:.0f} ms, max {stats['itl_max'] * 1e3:.0f} ms")
    print("   diagnosis:\n     " + diagnose(summaries)["verdict"].replace("\n", "\n     "))
    return stats


def calibrate(checkpoint, runner, args) -> tuple[float, float]:
    """An engine without chunked prefill, alone: the decode step of the D streams, and the
    prefill time of a mean long prompt."""
    rng = random.Random(args.seed + 1)
    vocab = checkpoint.config.vocab_size
    probe = build_engine(checkpoint, runner, False, args)
    streams = [[rng.randrange(100, vocab - 100) for _ in range(args.decoder_prompt)]
               for _ in range(args.decoders)]
    outs = probe.generate(streams, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    decode_step = statistics.median(g for o in outs for g in o.metrics.itl)
    long_len = (args.long_min + args.long_max) // 2
    start = time.perf_counter()
    probe.generate([[rng.randrange(100, vocab - 100) for _ in range(long_len)]],
                   SamplingParams(temperature=0, max_tokens=1))
    return decode_step, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.loader import load_checkpoint
    from engine.model_files import bundled_model_path

    checkpoint = load_checkpoint(args.model or bundled_model_path())
    chunked = build_engine(checkpoint, None, True, args)
    runner = chunked.model_runner

    # Calibrate: the decoders' pure decode step and the prefill rate, to size the schedule.
    decode_step, prefill_s = calibrate(checkpoint, runner, args)
    long_len = (args.long_min + args.long_max) // 2
    lifetime = args.decode_tokens * decode_step
    mean_gap = lifetime / (args.long_prompts + 1)
    print(f"workload: {args.decoders} streaming requests ({args.decoder_prompt}-token prompts, "
          f"{args.decode_tokens} output tokens) + {args.long_prompts} long prompts "
          f"({args.long_min}-{args.long_max} tokens, {args.long_output} output tokens), Poisson "
          f"arrivals, mean gap {mean_gap:.1f} s")
    print(f"calibration: {args.decoders}-request decode step {decode_step * 1e3:.0f} ms, "
          f"{long_len}-token prefill {prefill_s:.1f} s ({long_len / prefill_s:.0f} tok/s); "
          f"chunked budget {chunked.config.max_num_batched_tokens} tokens/step, threads "
          f"{torch.get_num_threads()}")

    workload = make_workload(args, checkpoint.config.vocab_size, mean_gap)
    print("long-prompt arrivals: " + ", ".join(
        f"{at:.1f} s ({len(p)} tok)" for at, kind, p, _ in workload if kind == "long"))
    labels = {"chunked": "chunked prefill",
              "unchunked": "unchunked (whole prompts, prefill-only steps)"}
    rounds: list[dict[str, dict]] = []
    summaries: dict[str, list] = {mode: [] for mode in labels}
    for r, order in enumerate(alternate(list(labels), args.rounds), start=1):
        stats = {}
        for mode in order:
            engine = chunked if r == 1 and mode == "chunked" else build_engine(
                checkpoint, runner, mode == "chunked", args)
            result = run(engine, workload)
            stats[mode] = report(f"round {r}/{args.rounds}: {labels[mode]}", result)
            summaries[mode].append(result["summaries"])
        rounds.append({"order": order, **stats})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summaries, f)
    ratios = {f"{key}_ratio": [r["chunked"][key] / r["unchunked"][key] for r in rounds]
              for key in ("tpot_p99", "ttft_p50", "throughput", "itl_p99", "itl_max")}
    print(json.dumps({
        "tpot_p99_chunked_ms": round(statistics.median(
            r["chunked"]["tpot_p99"] for r in rounds) * 1e3, 1),
        "tpot_p99_unchunked_ms": round(statistics.median(
            r["unchunked"]["tpot_p99"] for r in rounds) * 1e3, 1),
        **{key: round(statistics.median(values), 3) for key, values in ratios.items()},
        "rounds": [{"order": r["order"], **{key: round(values[i], 3)
                                            for key, values in ratios.items()}}
                   for i, r in enumerate(rounds)],
        "spread": {key: spread(values) for key, values in ratios.items()},
    }))


def alternate(modes: list[str], rounds: int) -> list[list[str]]:
    """Each round runs every mode; odd rounds in the given order, even rounds reversed."""
    return [modes if r % 2 == 0 else modes[::-1] for r in range(rounds)]


def spread(values: list[float]) -> float:
    """(max - min) / median over the rounds: how far one round can move a figure."""
    return round((max(values) - min(values)) / statistics.median(values), 3)


if __name__ == "__main__":
    main()
