"""Colocated vs disaggregated prefill/decode on the interference workload, in one run.

The workload is bench/interference.py's (imported, same flags and seed): D streaming requests
(short prompts, 256 output tokens) start together, L long prompts arrive on a Poisson schedule
while they stream. It runs on:

* colocated: one LLMEngine, chunked prefill, `--threads` torch threads (default 2);
* disaggregated: a prefill worker and a decode worker, one core each (engine/disaggregated.py),
  the KV of each prompt handed over gloo.

Per mode: long-prompt TTFT p50/p99, TPOT p50/p99 (all requests, and the streaming decoders'),
and goodput: requests per second of makespan that met both the TTFT and the TPOT objective
(printed; by default from the colocated engine's unloaded figures in the calibration: TTFT 2x
the prefill of a mean long prompt alone, TPOT 3x the decode step of the D streams alone). Each mode also
runs the streaming decoders with no long prompt at all: decode isolation = decoders' TPOT p99
under the long prompts / without them (1.0 = prefill load does not reach the decoders).

Both engines stay up and the modes alternate over `--rounds` rounds (colocated first in odd
rounds, disaggregated first in even ones), so load from other processes falls on both alike.
The last line is one JSON object; ratios are disaggregated / colocated, the median over the
rounds, with each round's ratios and their spread ((max - min) / median).

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.disagg
    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.disagg --decoders 8 \\
        --decode-tokens 128 --long-prompts 3        # a quicker run
"""

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys

import torch

from bench.interference import (
    alternate,
    build_engine,
    calibrate,
    make_workload,
    report,
    run,
    spread,
)
from engine import SamplingParams
from engine.diagnosis import percentile
from engine.disaggregated import DisaggregatedEngine


def parse_args() -> argparse.Namespace:
    # interference.py's flags (same defaults), plus ours.
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--ttft-slo", type=float, default=None,
                       help="TTFT objective in seconds (default: 2x the calibrated prefill "
                            "of a mean long prompt)")
    extra.add_argument("--tpot-slo", type=float, default=None,
                       help="TPOT objective in seconds (default: 3x the calibrated decode step "
                            "of the streaming requests)")
    extra.add_argument("--summaries", default=None,
                       help="write every request's timeline summary, per mode, round and run, "
                            "here (JSON)")
    ours, rest = extra.parse_known_args()
    from bench import interference

    sys.argv = [sys.argv[0], *rest]  # interference.parse_args reads the command line
    args = interference.parse_args()
    args.threads = args.threads or 2
    return argparse.Namespace(**vars(args), **vars(ours))


def goodput(result: dict, ttft_slo: float, tpot_slo: float) -> float:
    """Requests per second that met both objectives (one output token: TTFT only)."""
    good = sum(1 for s in result["summaries"]
               if s["ttft"] <= ttft_slo and (s["tpot"] is None or s["tpot"] <= tpot_slo))
    return good / result["makespan"]


def decoders_tpot_p99(result: dict) -> float:
    return percentile([s["tpot"] for s in result["summaries"] if s["kind"] == "decoder"], 99)


def measure(name: str, engine, workload: list[tuple], args, summaries: list) -> dict:
    """The workload, then the streaming requests alone; the stats of both."""
    loaded = run(engine, workload)
    alone = run(engine, [w for w in workload if w[1] == "decoder"])
    summaries.append({"loaded": loaded["summaries"], "alone": alone["summaries"]})
    stats = report(name, loaded)
    stats["goodput"] = goodput(loaded, args.ttft_slo, args.tpot_slo)
    stats["decoder_tpot_p99_alone"] = decoders_tpot_p99(alone)
    stats["decode_isolation"] = stats["decoder_tpot_p99"] / stats["decoder_tpot_p99_alone"]
    transfers = [s["kv_transfer_time"] for s in loaded["summaries"]
                 if s.get("kv_transfer_time") is not None]
    stats["kv_transfer_p50"] = percentile(transfers, 50)
    print(f"   goodput {stats['goodput']:.3f} req/s ({sum(1 for _ in loaded['summaries'])} "
          f"requests in {loaded['makespan']:.1f} s); streaming decoders' TPOT p99 "
          f"{stats['decoder_tpot_p99'] * 1e3:.0f} ms under load, "
          f"{stats['decoder_tpot_p99_alone'] * 1e3:.0f} ms alone: decode isolation "
          f"{stats['decode_isolation']:.2f}")
    if transfers:
        print(f"   KV transfer p50 {stats['kv_transfer_p50'] * 1e3:.1f} ms, max "
              f"{max(transfers) * 1e3:.1f} ms over {len(transfers)} hand-offs")
    return stats


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
          f"(other processes skew both modes, the 2-thread colocated one most)")
    from engine.loader import load_checkpoint
    from engine.model_files import bundled_model_path

    checkpoint = load_checkpoint(args.model or bundled_model_path())
    colocated = build_engine(checkpoint, None, True, args)
    # The same settings (and KV cache size, per worker) in disaggregated mode.
    config = dataclasses.replace(colocated.config, mode="disaggregated")
    decode_step, prefill_s = calibrate(checkpoint, colocated.model_runner, args)
    args.tpot_slo = args.tpot_slo or 3 * decode_step
    args.ttft_slo = args.ttft_slo or 2 * prefill_s
    mean_gap = args.decode_tokens * decode_step / (args.long_prompts + 1)
    workload = make_workload(args, checkpoint.config.vocab_size, mean_gap)
    print(f"workload: {args.decoders} streaming requests ({args.decoder_prompt}-token prompts, "
          f"{args.decode_tokens} output tokens) + {args.long_prompts} long prompts "
          f"({args.long_min}-{args.long_max} tokens, {args.long_output} output tokens), Poisson "
          f"arrivals, mean gap {mean_gap:.1f} s: "
          + ", ".join(f"{at:.1f} s ({len(p)} tok)" for at, kind, p, _ in workload
                      if kind == "long"))
    print(f"calibration (colocated, {args.threads} threads, alone): {args.decoders}-stream "
          f"decode step {decode_step * 1e3:.0f} ms, mean long prefill {prefill_s:.1f} s")
    print(f"objectives: TTFT <= {args.ttft_slo:.2f} s and TPOT <= {args.tpot_slo * 1e3:.0f} ms")

    checkpoint.weights = {}  # the workers load their own (the colocated model holds its copy)
    disagg = DisaggregatedEngine(config, checkpoint)
    rounds: list[dict] = []
    summaries: dict[str, list] = {"colocated": [], "disaggregated": []}
    try:
        disagg.wait_until_ready()
        info = disagg.worker_info
        # Warm both workers' kernels (first calls pay oneDNN's set-up) before measuring.
        rng = random.Random(args.seed + 2)
        vocab = checkpoint.config.vocab_size
        disagg.generate([[rng.randrange(100, vocab - 100) for _ in range(n)]
                         for n in (args.decoder_prompt, args.long_min)],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engines = {
            "colocated": (f"colocated ({args.threads} threads, chunked prefill)", colocated),
            "disaggregated": (f"disaggregated (prefill on cores {info['prefill'].cpus}, "
                              f"decode on {info['decode'].cpus}, one thread each)", disagg),
        }
        for r, order in enumerate(alternate(list(engines), args.rounds), start=1):
            stats = {}
            for mode in order:
                label, engine = engines[mode]
                stats[mode] = measure(f"round {r}/{args.rounds}: {label}", engine, workload,
                                      args, summaries[mode])
            rounds.append({"order": order, **stats})
    finally:
        disagg.close()

    if args.summaries:
        with open(args.summaries, "w") as f:
            json.dump(summaries, f)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")

    def ratios(key: str) -> list[float]:
        return [r["disaggregated"][key] / r["colocated"][key] for r in rounds]

    def median(mode: str, key: str, scale: float = 1.0, digits: int = 3) -> float:
        return round(statistics.median(r[mode][key] for r in rounds) * scale, digits)

    per_round = {"tpot_p99_ratio": ratios("tpot_p99"), "ttft_p99_ratio": ratios("ttft_p99")}
    if all(r["colocated"]["goodput"] for r in rounds):
        per_round["goodput_ratio"] = ratios("goodput")
    print(json.dumps({
        **{key: round(statistics.median(values), 3) for key, values in per_round.items()},
        "goodput_ratio": round(statistics.median(per_round["goodput_ratio"]), 3)
        if "goodput_ratio" in per_round else None,
        "kv_transfer_ms_p50": median("disaggregated", "kv_transfer_p50", 1e3, 2),
        "decode_isolation": median("disaggregated", "decode_isolation"),
        "colocated_decode_isolation": median("colocated", "decode_isolation"),
        "decoder_tpot_p99_ms": {mode: median(mode, "decoder_tpot_p99", 1e3, 1)
                                for mode in ("colocated", "disaggregated")},
        "ttft_p99_s": {mode: median(mode, "ttft_p99", digits=2)
                       for mode in ("colocated", "disaggregated")},
        "goodput_rps": {mode: median(mode, "goodput", digits=4)
                        for mode in ("colocated", "disaggregated")},
        "slo": {"ttft_s": round(args.ttft_slo, 3), "tpot_ms": round(args.tpot_slo * 1e3, 1)},
        "rounds": [{"order": r["order"], **{key: round(values[i], 3)
                                            for key, values in per_round.items()},
                    "decode_isolation": round(r["disaggregated"]["decode_isolation"], 3)}
                   for i, r in enumerate(rounds)],
        "spread": {key: spread(values) for key, values in per_round.items()},
    }))


if __name__ == "__main__":
    main()
