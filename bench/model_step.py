"""Micro-benchmark of one model step: decode latency against the memory roofline, prefill rate.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.model_step [--load] [--baseline]

Prints, for the bundled SmolLM2-135M (fp32, and bf16 where this CPU does bf16 natively):
* the memory read bandwidth measured in this run, and the batch-1 decode roofline it implies
  (bytes of weights read per step / bandwidth);
* batch-1 decode ms/step at two context lengths, and the ratio to that roofline;
* batched decode (8 and 64 sequences) ms/step and tokens/s;
* prefill tokens/s for a 512-token prompt, and the fp32/bf16 matmul times per token count
  behind ``engine.model.default_matmul_dtype``;
* with --load: cold (convert the GGUF into a fresh cache) and warm load times;
* with --bf16-blocks (only): batch-invariant decode steps reading the GGUF blocks as bf16
  products against the bf16 kernel, by rows (AVX512-BF16);
* with --baseline: transformers' batch-1 decode step on the same weights.
Times are medians over repeated steps; other processes on a 2-core machine move them by 10-30%.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import tempfile
import time

import torch

from bench import cpu
from engine import cpu_kernels
from engine.forward_batch import ForwardBatch
from engine.loader import load_gguf
from engine.model import LlamaModel, _Linear, native_bf16
from engine.model_files import bundled_model_path

BLOCK = 16


def median_seconds(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes/s that torch streams out of memory (a 512 MB sum)."""
    buffer = torch.ones(128 << 20)
    return buffer.numel() * 4 / min(median_seconds(buffer.sum, 5) for _ in range(2))


def decode_batch(num_seqs: int, context: int) -> tuple[ForwardBatch, int]:
    """One decode token for each of ``num_seqs`` sequences of ``context`` tokens."""
    blocks_per_seq = (context + BLOCK - 1) // BLOCK
    tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1)
    last = context - 1
    batch = ForwardBatch(
        input_ids=torch.randint(0, 49152, (num_seqs,)),
        positions=torch.full((num_seqs,), last),
        query_start=torch.arange(num_seqs + 1, dtype=torch.int32),
        context_lens=torch.full((num_seqs,), context, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=tables[:, last // BLOCK].long() * BLOCK + last % BLOCK,
        logits_indices=torch.arange(num_seqs),
        max_query_len=1,
        max_context_len=context,
    )
    return batch, num_seqs * blocks_per_seq


def prefill_batch(length: int) -> tuple[ForwardBatch, int]:
    blocks = (length + BLOCK - 1) // BLOCK
    batch = ForwardBatch(
        input_ids=torch.randint(0, 49152, (length,)),
        positions=torch.arange(length),
        query_start=torch.tensor([0, length], dtype=torch.int32),
        context_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(length),
        logits_indices=torch.tensor([length - 1]),
        max_query_len=length,
        max_context_len=length,
    )
    return batch, blocks


def step_seconds(model: LlamaModel, batch: ForwardBatch, num_blocks: int, repeat: int) -> float:
    cache = model.allocate_kv_cache(num_blocks, BLOCK)
    return median_seconds(lambda: model.forward(batch, cache), repeat)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step streams: every layer matrix and the LM head (norms are noise)."""
    c = model.config
    per_layer = (
        (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size
        + c.num_heads * c.head_dim * c.hidden_size
        + 3 * c.intermediate_size * c.hidden_size
    )
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return (c.num_layers * per_layer + c.vocab_size * c.hidden_size) * itemsize


def report_model(name: str, model: LlamaModel, bandwidth: float) -> None:
    roofline = weight_bytes(model) / bandwidth
    print(
        f"\n== {name}: {weight_bytes(model) / 1e6:.0f} MB of weights per decode step, "
        f"roofline {roofline * 1e3:.1f} ms/step at {bandwidth / 1e9:.1f} GB/s"
    )
    for context in (128, 1024):
        seconds = step_seconds(model, *decode_batch(1, context), repeat=30)
        print(
            f"decode batch 1, context {context:5d}: {seconds * 1e3:6.1f} ms/step "
            f"= {seconds / roofline:.2f} x roofline"
        )
    for num_seqs in (8, 64):
        seconds = step_seconds(model, *decode_batch(num_seqs, 384), repeat=8)
        print(
            f"decode batch {num_seqs:2d}, context   384: {seconds * 1e3:6.1f} ms/step, "
            f"{num_seqs / seconds:6.0f} tok/s"
        )
    seconds = step_seconds(model, *prefill_batch(512), repeat=4)
    print(f"prefill 512 tokens: {seconds * 1e3:.0f} ms, {512 / seconds:.0f} tok/s")


def report_matmul_crossover() -> None:
    """fp32 vs bf16 vs GGUF Q4_1 blocks (cpu_kernels.QuantLinear, float32 arithmetic) and, on
    AVX512-BF16, the blocks as bf16 products (cpu_kernels.BlockBf16Linear): time of one layer's
    four matmuls by token count (bf16 as the engine runs it: our kernel where the CPU has
    AVX512-BF16, oneDNN otherwise). One layer's weights stay in cache here, which flatters the
    dense kernels against the blocks: engine.model.BLOCK_MAX_ROWS and BLOCK_BF16_MAX_ROWS come
    from whole decode steps, whose weights stream from memory (on 2 Zen 5 cores the blocks lose
    at every row count here, but win a decode step up to 7 rows; see --bf16-blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    fp32 = [_Linear(torch.randn(o, i)) for o, i in shapes]
    blocks = [cpu_kernels.QuantLinear(torch.from_numpy(quantize(
        torch.randn(o, i).numpy(), GGMLQuantizationType.Q4_1)), "Q4_1", i) for o, i in shapes]
    if cpu_kernels.bf16_linear_supported():
        bf16, kind = [cpu_kernels.Bf16Linear(torch.randn(o, i)) for o, i in shapes], "kernel"
    else:
        bf16, kind = [_Linear(torch.randn(o, i).bfloat16()) for o, i in shapes], "oneDNN"
    # the blocks as bf16 products, the bf16 kernel's AVX512-BF16 bits (batch-invariant mode's
    # steps of few rows there: engine.model.BLOCK_BF16_MAX_ROWS)
    as_bf16 = ([cpu_kernels.BlockBf16Linear(b) for b in blocks]
               if "avx512" in cpu_kernels.bf16_linear_paths() else None)
    print(f"\n== one layer's matmuls, fp32 (oneDNN) vs bf16 ({kind}), by tokens per step")
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        xs = [torch.randn(tokens, i) for _, i in shapes]

        def seconds(kernels, xs=xs):
            return median_seconds(lambda: [f(x) for f, x in zip(kernels, xs, strict=True)], 10)

        t32, t16, tq = seconds(fp32), seconds(bf16), seconds(blocks)
        line = (f"{tokens:4d} tokens: fp32 {t32 * 1e6:8.0f} us  bf16 {t16 * 1e6:8.0f} us  "
                f"Q4_1 blocks {tq * 1e6:8.0f} us  bf16/fp32 {t16 / t32:.2f}  "
                f"blocks/best {tq / min(t16, t32):.2f}")
        if as_bf16 is not None:
            tb = seconds(as_bf16)
            line += f"  blocks as bf16 {tb * 1e6:8.0f} us  as bf16/bf16 {tb / t16:.2f}"
        print(line)


def report_bf16_blocks_steps(checkpoint) -> None:
    """Batch-invariant decode steps (context 256) whose matmuls read the GGUF blocks as bf16
    products against the same steps on the bf16 kernel -- the same bits -- by rows: the measure
    behind engine.model.BLOCK_BF16_MAX_ROWS. The two alternate in one process, each step after
    a 400 MB sweep, so the weights come from memory as in a server's decode."""
    model = LlamaModel(checkpoint.config, checkpoint.weights, matmul_dtype=torch.bfloat16,
                       batch_invariant=True, quantized=checkpoint.quantized)
    (_, reading_blocks), *dense = model.block_stacks
    stacks = {"blocks as bf16": [(math.inf, reading_blocks)], "bf16 kernel": dense}
    sweep = torch.ones(100 << 20)
    print(f"\n== batch-invariant decode steps: {model.weights_format}")
    for rows in (1, 2, 4, 8, 12, 16, 24, 32):
        batch, num_blocks = decode_batch(rows, 256)
        cache = model.allocate_kv_cache(num_blocks, BLOCK)
        times: dict[str, list[float]] = {name: [] for name in stacks}
        for turn in range(16):
            for name in sorted(stacks, reverse=turn % 2 == 1):
                model.block_stacks = stacks[name]
                sweep.sum()
                step = functools.partial(model.forward, batch, cache)
                times[name].append(median_seconds(step, 3, warmup=1))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"rows {rows:2d}: blocks as bf16 {ms['blocks as bf16']:6.2f} ms, bf16 kernel "
              f"{ms['bf16 kernel']:6.2f} ms, ratio {ms['blocks as bf16'] / ms['bf16 kernel']:.3f}")


def report_load() -> None:
    path = bundled_model_path()
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        checkpoint = load_gguf(path, cache_dir=cache)
        LlamaModel(checkpoint.config, checkpoint.weights)
        cold = time.perf_counter() - start
        del checkpoint
        start = time.perf_counter()
        checkpoint = load_gguf(path, cache_dir=cache)
        LlamaModel(checkpoint.config, checkpoint.weights)
        warm = time.perf_counter() - start
    print(
        f"\n== load + build the model: cold (convert GGUF) {cold:.1f} s, warm (cache) {warm:.1f} s"
    )


def report_transformers_baseline(bandwidth: float, ours: LlamaModel) -> None:
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = bundled_model_path()
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = LlamaForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    print(f"\n== transformers: GGUF load {time.perf_counter() - start:.1f} s")
    ids = torch.randint(0, 49152, (1, 127))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        token = torch.tensor([[5]])

        def step():
            model(token, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token again: every step sees 127 cached tokens

        seconds = median_seconds(step, 30)
    ours_seconds = step_seconds(ours, *decode_batch(1, 128), repeat=30)
    print(
        f"transformers decode batch 1, context 128: {seconds * 1e3:.1f} ms/step; "
        f"ours {ours_seconds * 1e3:.1f} ms/step ({seconds / ours_seconds:.1f}x faster), "
        f"roofline {weight_bytes(ours) / bandwidth * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--crossover-only", action="store_true",
                        help="only the matmul crossover (fp32, bf16, GGUF blocks)")
    parser.add_argument("--bf16-blocks", action="store_true",
                        help="only batch-invariant decode steps reading the blocks as bf16 "
                             "products against the bf16 kernel (AVX512-BF16)")
    parser.add_argument("--load", action="store_true", help="also time cold and warm loading")
    parser.add_argument("--baseline", action="store_true", help="also time transformers")
    args = parser.parse_args()

    print(f"CPU: {cpu.label()}")
    torch.manual_seed(0)
    if args.crossover_only:
        with torch.inference_mode():
            report_matmul_crossover()
        return
    if args.bf16_blocks:
        if "avx512" not in cpu_kernels.bf16_linear_paths():
            raise SystemExit("--bf16-blocks needs the bf16 kernel's AVX512-BF16 path")
        with torch.inference_mode():
            report_bf16_blocks_steps(load_gguf(bundled_model_path()))
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"native bf16: {native_bf16()}"
    )
    if args.load:
        report_load()
    checkpoint = load_gguf(bundled_model_path())
    bandwidth = read_bandwidth()
    fp32 = LlamaModel(checkpoint.config, checkpoint.weights)
    with torch.inference_mode():
        report_model("fp32", fp32, bandwidth)
        if native_bf16():
            report_model(
                "bf16",
                LlamaModel(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16),
                bandwidth,
            )
            mixed = LlamaModel(
                checkpoint.config, checkpoint.weights, matmul_dtype=torch.bfloat16
            )
            seconds = step_seconds(mixed, *prefill_batch(512), repeat=4)
            print(
                "\nfp32 model, bf16 matmuls: "
                f"prefill 512 tokens {512 / seconds:.0f} tok/s"
            )
        report_matmul_crossover()
        if args.baseline:
            report_transformers_baseline(bandwidth, fp32)


if __name__ == "__main__":
    main()
