"""Batch-invariant mode on the bundled model: a request's logits are bit-identical (torch.equal)
at every step whether it runs alone or beside 1, 7, 31 or 63 random companions, wherever it sits
in the batch, whatever its prefill chunk boundaries, and whether its prefix came from the prefix
cache or was computed. The same runs with the mode off count how often the bits differ.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import (  # noqa: F401 (fixtures)
    CHAT_PROMPTS,
    bundled_cache_dir,
    bundled_checkpoint,
    needs_kernels,
)

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.batch_invariant import PROBE_ROWS, make_linears_invariant
from engine.cpu_kernels import bf16_linear_paths
from engine.model import (
    LlamaModel,
    _Linear,
    block_bf16_max_rows,
    default_kv_cache_dtype,
    default_matmul_dtype,
)
from engine.model_runner import ModelRunner

MAX_TOKENS = 5
COMPANIONS = (1, 7, 31, 63)
BUDGETS = (64, 96, 128, 192)  # token budgets per step: each moves the chunk boundaries


def target_prompts(tokenizer) -> list[list[int]]:
    """20 prompts of 17 to ~140 tokens."""
    rng = random.Random(7)
    prompts = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.encode(text)
        while len(ids) < rng.randrange(16, 140):
            ids += tokenizer.encode(" " + rng.choice(CHAT_PROMPTS))
        prompts.append(ids)
    return prompts


class Runs:
    """One model and KV cache per mode; every run gets a fresh engine (an empty prefix cache:
    the blocks of earlier runs are free and their stale contents never read)."""

    NUM_BLOCKS = 1000

    def __init__(self, checkpoint, batch_invariant: bool):
        self.checkpoint = checkpoint
        # as the engine builds it: bf16 matmuls where the CPU has native bf16, the GGUF's
        # blocks read directly by matmuls of few rows; in the mode every row of a matmul runs
        # in one arithmetic: the bf16 kernel's where the CPU has it (its AVX512-BF16 bits read
        # from the blocks for few rows), else the blocks'
        self.model = LlamaModel(checkpoint.config, checkpoint.weights,
                                matmul_dtype=default_matmul_dtype(torch.float32),
                                batch_invariant=batch_invariant,
                                quantized=checkpoint.quantized)
        if batch_invariant:
            paths = bf16_linear_paths()
            one_arithmetic = ("bfloat16" if paths[:1] == ["amx"] else
                              f"gguf Q4_1+Q8_0 blocks as bf16 up to {block_bf16_max_rows()} rows, "
                              "bfloat16 above" if paths else "gguf Q4_1+Q8_0 blocks")
            assert self.model.weights_format == one_arithmetic
        self.kv_cache = self.model.allocate_kv_cache(
            self.NUM_BLOCKS, 16, default_kv_cache_dtype(None, torch.float32))
        self.batch_invariant = batch_invariant

    def engine(self, budget: int) -> LLMEngine:
        config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=budget, block_size=16,
                              num_kv_blocks=self.NUM_BLOCKS, max_model_len=1024,
                              batch_invariant=self.batch_invariant)
        runner = ModelRunner(self.model, self.kv_cache, config.block_size, config.num_kv_blocks,
                             vocab_size=self.checkpoint.config.vocab_size)
        return LLMEngine(config, runner)

    def run(self, batch: list[tuple[str, list[int]]], budget: int,
            warm: list[list[int]] = ()) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """Logits per step of every request in ``batch`` (all submitted at once, in order), and
        each request's prefix-cache hit in tokens. ``warm`` prompts run first, to completion,
        so that the batch finds their blocks in the prefix cache."""
        engine = self.engine(budget)
        for i, prompt in enumerate(warm):
            engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=f"warm{i}")
        while engine.has_unfinished_requests():
            engine.step()
        logits: dict[str, list[torch.Tensor]] = {rid: [] for rid, _ in batch}

        def keep(seqs, rows):
            for seq, row in zip(seqs, rows, strict=True):
                logits[seq.request_id].append(row.clone())

        engine.model_runner.logits_hook = keep
        seqs = {}
        for rid, prompt in batch:
            # targets greedy, companions sampled (their seeds follow the request order)
            temperature = 0.0 if rid.startswith("t") else 0.8
            engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      temperature=temperature),
                               request_id=rid)
            seqs[rid] = engine.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.block_manager.num_free_blocks == self.NUM_BLOCKS
        return logits, {rid: s.timeline.num_cached_tokens for rid, s in seqs.items()}


def companions(rng: random.Random, n: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


def compare_modes(checkpoint, batch_invariant: bool, num_prompts: int = len(CHAT_PROMPTS),
                  companion_counts: tuple[int, ...] = COMPANIONS) -> tuple[int, int, int]:
    """(steps compared, steps whose logits differ from the solo run, prefix-cache hits seen)."""
    runs = Runs(checkpoint, batch_invariant)
    prompts = target_prompts(checkpoint.tokenizer)[:num_prompts]
    vocab = checkpoint.config.vocab_size
    solo = [runs.run([("t", p)], BUDGETS[i % len(BUDGETS)])[0]["t"] for i, p in enumerate(prompts)]
    rng = random.Random(11)
    compared = differing = hits = 0
    for n_companions in companion_counts:
        k = COMPANIONS.index(n_companions)
        budget = BUDGETS[(k + 1) % len(BUDGETS)]
        group = max(1, min(len(prompts), (n_companions + 1) // 2))  # targets sharing a batch
        for first in range(0, len(prompts), group):
            targets = list(range(first, min(first + group, len(prompts))))
            others = companions(rng, n_companions + 1 - len(targets), vocab)
            batch = [(f"c{i}", p) for i, p in enumerate(others)]
            for t in targets:  # each target at a random place among the others
                batch.insert(rng.randrange(len(batch) + 1), (f"t{t}", prompts[t]))
            # From 31 companions on, half the targets find most of their prompt cached.
            warm = [prompts[t][: len(prompts[t]) * 2 // 3] for t in targets[::2]
                    if n_companions >= 31]
            logits, cached = runs.run(batch, budget, warm)
            for t in targets:
                got = logits[f"t{t}"]
                assert len(got) == len(solo[t]) == MAX_TOKENS
                compared += len(got)
                differing += sum(not torch.equal(a, b) for a, b in zip(got, solo[t], strict=True))
                hits += cached[f"t{t}"] > 0
    return compared, differing, hits


@pytest.mark.slow
def test_logits_bit_identical_in_any_batch(bundled_checkpoint):
    needs_kernels()
    compared, differing, hits = compare_modes(bundled_checkpoint, batch_invariant=True)
    print(f"batch_invariant on: {differing} of {compared} steps differ; {hits} prefix hits")
    assert compared == len(CHAT_PROMPTS) * len(COMPANIONS) * MAX_TOKENS
    assert hits >= 10  # the cached-prefix case really ran
    assert differing == 0


@pytest.mark.slow
def test_logits_differ_without_the_mode(bundled_checkpoint):
    """The control: the same comparison with the mode off finds companions changing the bits
    (the full batch of 63 companions, half the targets, is enough to show it)."""
    compared, differing, _ = compare_modes(bundled_checkpoint, batch_invariant=False,
                                           num_prompts=len(CHAT_PROMPTS) // 2,
                                           companion_counts=(63,))
    print(f"batch_invariant off: {differing} of {compared} steps differ")
    assert differing > 0


def test_linear_paths_are_row_invariant():
    """Both linear paths give each row the same bits for any row count: rows (at least two,
    probed) and the fixed-tile fallback, which a probe failure selects."""
    torch.manual_seed(0)
    for out_features, in_features in ((96, 64), (64, 1536)):
        for path in ("rows", "tiles"):
            linear = _Linear(torch.randn(out_features, in_features))
            chosen = make_linears_invariant([linear])
            if path == "tiles":
                linear.min_rows, linear.row_tile = 0, 64
            else:
                assert chosen == {(out_features, in_features, "float32"): "rows"}
            x = torch.randn(300, in_features)
            full = linear(x)
            for m in (1, 2, 5, 64, 65, 129, 300):
                assert torch.equal(linear(x[:m]), full[:m]), (path, m)
    assert 2 in PROBE_ROWS


def test_mode_settings_are_checked():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, dtype="bfloat16")


def test_the_mode_is_on_by_default_wherever_it_runs(monkeypatch):
    """``batch_invariant="auto"`` (the default): on for float32 on the CPU with the kernels,
    off where the mode cannot run (no kernels, other dtypes or devices), where ``True`` refuses."""
    from engine import cpu_kernels

    assert EngineConfig().batch_invariant is cpu_kernels.available()
    assert EngineConfig(dtype="bfloat16").batch_invariant is False
    assert EngineConfig(device="cuda").batch_invariant is False
    assert EngineConfig(batch_invariant=False).batch_invariant is False
    with pytest.raises(ValueError, match="needs dtype float32 on the CPU"):
        EngineConfig(dtype="bfloat16", batch_invariant=True)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # a host without a compiler
    assert EngineConfig().batch_invariant is False
