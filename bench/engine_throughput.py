"""Offline throughput: N concurrent requests through the engine vs transformers `generate`.

Workload (fixed seed): prompts of 128 to 512 random token ids, 128 output tokens each, EOS
ignored, greedy. The engine gets every request at once (continuous batching); transformers gets
the same requests in static batches (left-padded), with the same weights (the engine's loaded
checkpoint, put into transformers' LlamaForCausalLM, loaded strictly) and thread count; the vLLM
CPU peer (bench/peers/vllm_cpu.sh setup) the same requests in its own Python, through
bench/vllm_peer.py.

Fairness: each side runs its own fastest honest configuration on this CPU, and the output says
which: the engine as it serves (bf16 matmuls and KV cache where the CPU has bf16 dot products,
the GGUF blocks for matmuls of few rows), transformers in whichever of float32 and bf16 a probe
finds faster here, vLLM in bf16 only where the CPU has bf16 instructions. Every side runs
``--rounds`` times, alternated (engine, transformers, vLLM, engine, ...; prefix cache emptied
before each engine round); each side's best round is compared, and every round is printed.

Also printed: the machine's memory read bandwidth (see read_bandwidth_gbs), the batch-1 decode
roofline (the bytes a decode step reads, in the format the engine reads them, / bandwidth), the
engine's measured batch-1 decode step (the two alternated: batch1_against_roofline), the greedy
agreement between the sides, and the token positions each side runs through the layers
(``hf_work_ratio``: transformers' static batches pad every prompt to its batch's longest), which
splits the ratio to transformers into work saved and speed per position. The last line is one
JSON object.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.engine_throughput
    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.engine_throughput \
        --num-requests 16 --hf-requests 8          # a quick run
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench import cpu
from engine import EngineConfig, LLMEngine, SamplingParams

PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "inherent-peers"))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's flags, shared with the benches that reuse it (bench/batch_invariance.py)."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)


def parse_args() -> argparse.Namespace:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--hf-requests", type=int, default=None,
                   help="requests for transformers (default: all); 0 skips it")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32",
                   help="the engine's model dtype (its matmuls follow the CPU, see README)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=defaults.max_num_batched_tokens)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each side, alternated; the best of each is reported")
    return p.parse_args()


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(low, high))]
            for _ in range(n)]


def read_bandwidth_gbs(repeats: int = 8) -> float:
    """Memory read bandwidth over a 256 MB float32 matrix: the better of a matrix-vector product
    (how a decode reads weights) and a plain reduction, best of several runs each. On 2 Zen 4
    cores the GEMV reads ~20 GB/s and the reduction ~29 (the engine's bf16 matmul kernel streams
    its weights at ~29): the roofline must come from the faster, or it is no bound."""
    w = torch.randn(8192, 8192)
    x = torch.randn(8192)
    best = float("inf")
    for read in (lambda: torch.mv(w, x), w.amax):
        read()
        for _ in range(repeats):
            t = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t)
    return w.numel() * w.element_size() / best / 1e9


class ForwardTimer:
    """Wraps the model's forward to split engine time into model time and the rest."""

    def __init__(self, model):
        self.model, self.forward, self.seconds, self.calls = model, model.forward, 0.0, 0
        model.forward = self

    def __call__(self, batch, kv_cache):
        t = time.perf_counter()
        logits = self.forward(batch, kv_cache)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return logits


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    engine.generate([p[:32] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
    engine.reset_prefix_cache()  # every round computes every prompt
    timer = ForwardTimer(engine.model_runner.model)
    steps = engine.num_steps
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    timer.model.forward = timer.forward
    return {
        "elapsed": elapsed,
        "outputs": [o.token_ids for o in outs],
        "out_tokens": sum(len(o.token_ids) for o in outs),
        "steps": engine.num_steps - steps,
        "forward_seconds": timer.seconds,
        "preemptions": engine.scheduler.num_preemptions,
    }


def batch1_decode_ms(engine: LLMEngine, prompt: list[int]) -> float:
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=64,
                                                   ignore_eos=True))[0]
    return statistics.median(out.metrics.itl) * 1e3


def batch1_against_roofline(engine: LLMEngine, prompt: list[int],
                            pairs: int = 3) -> tuple[float, float]:
    """The batch-1 decode step (ms, the median of ``pairs`` runs) and the read bandwidth
    (GB/s, the best of as many probes), alternated in the same minute: on a shared host the
    probe read 33-63 GB/s within minutes (Zen 4 kind), so a probe taken minutes from the
    decodes it bounds says more about the neighbours than about the engine."""
    decodes, bandwidths = [], []
    for _ in range(pairs):
        bandwidths.append(read_bandwidth_gbs())
        decodes.append(batch1_decode_ms(engine, prompt))
    print("batch-1 decode ms / read GB/s, alternated: " + ", ".join(
        f"{d:.2f} / {b:.1f}" for d, b in zip(decodes, bandwidths, strict=True)))
    return statistics.median(decodes), max(bandwidths)


def transformers_model(checkpoint):
    """transformers' Llama on the checkpoint's weights, loaded strictly: every parameter from
    the checkpoint (the LM head too, unless tied to the embedding), nothing left over."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**checkpoint.config.to_hf()))
    weights = {k: v for k, v in checkpoint.weights.items() if k != "rope_freqs"}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set()
    if unexpected or set(missing) != tied:
        raise RuntimeError(f"transformers' Llama does not take these weights as they are: "
                           f"missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def fastest_transformers_dtype(model, prompts: list[list[int]],
                               pad: int) -> tuple[torch.dtype, dict[str, float]]:
    """float32 or bf16, whichever runs 16 prompts' prefill and 8 decode steps faster here (best
    of 2 each; bf16 loses badly on CPUs without bf16 instructions): the model is left in it."""
    timings = {}
    batch = [p[:128] for p in prompts[:16]]
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        timings[dtype] = min(hf_generate(model, batch, 8, pad)[1] for _ in range(2))
    best = min(timings, key=timings.get)
    model.to(best)
    return best, {str(d).removeprefix("torch."): round(t, 2) for d, t in timings.items()}


def hf_generate(model, batch: list[list[int]], new_tokens: int,
                pad: int) -> tuple[list[list[int]], float]:
    """One static batch, left-padded, greedy: (new tokens per prompt, seconds)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False)
    return out[:, width:].tolist(), time.perf_counter() - t


def layer_positions(prompts: list[list[int]], output_tokens: int,
                    batch_size: int | None = None) -> int:
    """Token positions the model's layers run over, the bulk of either side's arithmetic: every
    prompt token, and every output token but the last (sampled, never fed back). In static
    batches of ``batch_size`` (transformers), each prompt counts as its batch's longest: the
    left padding runs through the layers too."""
    if batch_size is None:
        return sum(map(len, prompts)) + len(prompts) * (output_tokens - 1)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    return sum(len(batch) * (max(map(len, batch)) + output_tokens - 1) for batch in batches)


def run_transformers(model, prompts: list[list[int]], output_tokens: int, batch_size: int,
                     pad: int) -> dict:
    hf_generate(model, [prompts[0][:16]], 2, pad)  # warm-up
    elapsed, outputs = 0.0, []
    for i in range(0, len(prompts), batch_size):
        out, seconds = hf_generate(model, prompts[i : i + batch_size], output_tokens, pad)
        outputs += out
        elapsed += seconds
    return {"elapsed": elapsed, "outputs": outputs}


def run_vllm(prompts: list[list[int]], output_tokens: int, threads: int) -> dict | None:
    """The vLLM CPU peer on the same prompt ids, in its own venv and process, with the settings
    of bench/peers/vllm_cpu.sh. None, after saying why, when it is absent or fails."""
    python, model = PEERS / "vllm" / "bin" / "python", PEERS / "models" / "smollm2-135m-instruct"
    if not (python.exists() and model.is_dir()):
        print("vLLM CPU peer: not set up (bench/peers/vllm_cpu.sh setup); skipped")
        return None
    env = ({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
           | os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(PEERS / "cache" / "vllm"),
                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    with tempfile.TemporaryDirectory() as tmp:
        requests, result = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        requests.write_text(json.dumps({"prompts": prompts, "output_tokens": output_tokens}))
        run = subprocess.run([str(python), str(Path(__file__).with_name("vllm_peer.py")),
                              str(model), str(requests), str(result)],
                             env=env, capture_output=True, text=True, check=False)
        if run.returncode:
            print(f"vLLM run failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
            return None
        return json.loads(result.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """Fraction of requests with identical outputs; mean fraction of tokens before the first
    difference."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b, strict=False):
        same += x == y
        k = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
        prefix += k / max(1, len(x))
    n = max(1, min(len(a), len(b)))
    return same / n, prefix / n


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from engine.loader import load_checkpoint
    from engine.model_files import bundled_model_path

    checkpoint = load_checkpoint(args.model or bundled_model_path())
    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill, max_model_len=2048, seed=args.seed,
    )
    from engine.model_runner import ModelRunner

    engine = LLMEngine(config, ModelRunner.from_checkpoint(checkpoint, config),
                       checkpoint.tokenizer, model_id=checkpoint.model_id)
    prompts = random_prompts(args.num_requests, args.min_prompt, args.max_prompt,
                             checkpoint.config.vocab_size, args.seed)
    prompt_tokens = sum(map(len, prompts))
    print(f"CPU: {cpu.label()}")
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} "
          f"tokens ({prompt_tokens} in all), {args.output_tokens} output tokens each, "
          f"{args.dtype}, {args.threads} threads")
    print(f"engine: block_size={config.block_size} max_num_seqs={config.max_num_seqs} "
          f"max_num_batched_tokens={config.max_num_batched_tokens} "
          f"chunked_prefill={config.enable_chunked_prefill} kv_blocks="
          f"{engine.model_runner.num_kv_blocks}")

    model = engine.model_runner.model
    engine_dtypes = (f"matmuls {str(model.matmul_dtype).removeprefix('torch.')}, KV cache "
                     f"{str(engine.model_runner.kv_cache[0].dtype).removeprefix('torch.')}, "
                     f"weights read as {model.weights_format}")
    print(f"engine precision: {engine_dtypes}")
    hf_n = args.num_requests if args.hf_requests is None else args.hf_requests
    hf_batch = min(args.hf_batch_size, hf_n)
    hf_model = hf_dtype = None
    pad = engine.tokenizer.eos_token_ids[0]
    if hf_n:
        hf_model = transformers_model(checkpoint)
        hf_model.generation_config.eos_token_id = None  # ignore EOS, like the engine run
        hf_model.generation_config.pad_token_id = pad
        hf_dtype, probe = fastest_transformers_dtype(hf_model, prompts, pad)
        print(f"transformers: {str(hf_dtype).removeprefix('torch.')} (probe seconds {probe})")
    rounds, hf_rounds, vllm_rounds = [], [], []
    # Alternated, best of each: a shared VM's neighbours slow runs unevenly (the same vLLM run
    # measured 186 and 237 output tok/s an hour apart on this machine).
    for r in range(1, args.rounds + 1):
        print(f"round {r}: load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores; other "
              "processes slow every run)")
        ours = run_engine(engine, prompts, args.output_tokens)
        rounds.append(ours)
        overhead = ours["elapsed"] - ours["forward_seconds"]
        print(f"  engine:       {ours['elapsed']:.1f} s, "
              f"{ours['out_tokens'] / ours['elapsed']:.1f} output tok/s, "
              f"{(ours['out_tokens'] + prompt_tokens) / ours['elapsed']:.1f} total tok/s; "
              f"{ours['steps']} steps, model forward {ours['forward_seconds']:.1f} s, everything "
              f"else {overhead:.1f} s ({overhead / ours['steps'] * 1e3:.2f} ms/step), "
              f"{ours['preemptions']} preemptions")
        if hf_model is not None:
            hf = run_transformers(hf_model, prompts[:hf_n], args.output_tokens, hf_batch, pad)
            hf_rounds.append(hf)
            print(f"  transformers: {hf['elapsed']:.1f} s, "
                  f"{hf_n * args.output_tokens / hf['elapsed']:.1f} output tok/s ({hf_n} "
                  f"requests, static batches of {hf_batch}, {hf_dtype})")
        vllm = None if args.skip_vllm else run_vllm(prompts, args.output_tokens, args.threads)
        if vllm is not None:
            vllm_rounds.append(vllm)
            vllm_out_tokens = sum(map(len, vllm["outputs"]))
            print(f"  vLLM CPU:     {vllm['elapsed']:.1f} s, "
                  f"{vllm_out_tokens / vllm['elapsed']:.1f} output tok/s, "
                  f"{(vllm_out_tokens + prompt_tokens) / vllm['elapsed']:.1f} total tok/s "
                  f"({vllm['dtype']}, the same {args.num_requests} requests)")

    ours = min(rounds, key=lambda run: run["elapsed"])
    out_tok_s = ours["out_tokens"] / ours["elapsed"]
    print(f"engine, best of {len(rounds)}: {out_tok_s:.1f} output tok/s, "
          f"{(ours['out_tokens'] + prompt_tokens) / ours['elapsed']:.1f} total tok/s")
    decode_ms, bandwidth = batch1_against_roofline(engine, prompts[0][:128])
    weight_bytes = model.decode_weight_bytes
    roofline_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(f"memory read bandwidth {bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB -> "
          f"batch-1 decode roofline {roofline_ms:.1f} ms/step; measured {decode_ms:.1f} ms/step")

    result = {"out_tok_s": round(out_tok_s, 1), "decode_b1_ms": round(decode_ms, 2),
              "roofline_b1_ms": round(roofline_ms, 2), "bandwidth_gbs": round(bandwidth, 1),
              "num_requests": args.num_requests, "cpu": cpu.describe(),
              "engine_precision": engine_dtypes, "weights_format": model.weights_format,
              "decode_weight_mb": round(weight_bytes / 1e6, 1),
              "engine_rounds_out_tok_s": [round(run["out_tokens"] / run["elapsed"], 1)
                                          for run in rounds]}
    if hf_rounds:
        hf = min(hf_rounds, key=lambda run: run["elapsed"])
        hf_tok_s = hf_n * args.output_tokens / hf["elapsed"]
        exact, prefix = agreement(ours["outputs"][:hf_n], hf["outputs"])
        print(f"ratio engine/transformers: {out_tok_s / hf_tok_s:.2f}x; greedy match: "
              f"{exact:.0%} of requests identical, {prefix:.0%} of tokens before the first "
              f"difference")
        # What the ratio would be at equal speed per position: the rest is arithmetic speed.
        ours_work = layer_positions(prompts[:hf_n], args.output_tokens)
        hf_work = layer_positions(prompts[:hf_n], args.output_tokens, hf_batch)
        work_ratio = hf_work / ours_work
        print(f"work: transformers runs {hf_work} token positions through the layers, the "
              f"engine {ours_work} ({work_ratio:.2f}x, the padding); per position the engine "
              f"is {out_tok_s / hf_tok_s / work_ratio:.2f}x faster")
        result |= {"hf_out_tok_s": round(hf_tok_s, 1),
                   "ratio_vs_hf": round(out_tok_s / hf_tok_s, 2),
                   "hf_work_ratio": round(work_ratio, 3),
                   "hf_dtype": str(hf_dtype).removeprefix("torch."),
                   "greedy_match": round(exact, 3), "greedy_prefix_match": round(prefix, 3),
                   "hf_requests": hf_n,
                   "hf_rounds_out_tok_s": [round(hf_n * args.output_tokens / run["elapsed"], 1)
                                           for run in hf_rounds]}
    if vllm_rounds:
        vllm = min(vllm_rounds, key=lambda run: run["elapsed"])
        vllm_tok_s = sum(map(len, vllm["outputs"])) / vllm["elapsed"]
        # vLLM runs all of it in its dtype, the engine only its matmuls and KV in bf16 (on
        # bf16 CPUs): greedy outputs may part early.
        exact, prefix = agreement(ours["outputs"], vllm["outputs"])
        print(f"vLLM, best of {len(vllm_rounds)}: {vllm_tok_s:.1f} output tok/s")
        print(f"ratio engine/vLLM: {out_tok_s / vllm_tok_s:.2f}x; greedy match: {exact:.0%} of "
              f"requests identical, {prefix:.0%} of tokens before the first difference")
        result |= {"vllm_out_tok_s": round(vllm_tok_s, 1),
                   "ratio_vs_vllm": round(out_tok_s / vllm_tok_s, 2),
                   "vllm_greedy_match": round(exact, 3), "vllm_dtype": vllm["dtype"],
                   "vllm_rounds_out_tok_s": [
                       round(sum(map(len, run["outputs"])) / run["elapsed"], 1)
                       for run in vllm_rounds]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
