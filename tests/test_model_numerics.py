"""The model against transformers: same logits, same greedy text, however the tokens are batched.

Fast tests use a tiny random Llama written as a Hugging Face folder; the slow ones load the
bundled SmolLM2-135M GGUF and transformers' own GGUF loading of it.
"""

import math

import pytest
import torch
from engine_fixtures import (  # noqa: F401 (fixtures)
    CHAT_PROMPTS,
    PagedRunner,
    bundled_cache_dir,
    bundled_checkpoint,
    bundled_model,
    chat,
    greedy_generate,
    hf_model,
    until_eos,
    write_tiny_llama,
)

from engine.loader import load_hf_dir
from engine.model import (
    BLOCK_MAX_ROWS,
    LlamaModel,
    ModelConfig,
    allocate_kv_cache,
    block_bf16_max_rows,
    cpu_is_zen4,
    default_matmul_dtype,
    native_bf16,
    rope_inv_freq,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama and transformers' LlamaForCausalLM on the same folder."""
    from transformers import LlamaForCausalLM

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    checkpoint = load_hf_dir(path)
    return LlamaModel(checkpoint.config, checkpoint.weights), LlamaForCausalLM.from_pretrained(
        path
    ).eval()


def test_tiny_model_matches_transformers_at_every_position(tiny):
    model, reference = tiny
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = PagedRunner(model)
    ours = runner.step([("a", ids)])  # last position only
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours[0], theirs[-1], atol=1e-4, rtol=1e-4)
    # then token by token (decode steps) over the same cache
    for step in range(8):
        token = int(theirs[-1].argmax())
        ids.append(token)
        ours = runner.step([("a", [token])])
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(
            ours[0], theirs[-1], atol=1e-4, rtol=1e-4, msg=f"decode step {step}"
        )


@pytest.mark.parametrize("chunks", [(40,), (16, 16, 8), (1, 20, 19), (7, 1, 32)])
def test_chunked_prefill_matches_one_shot(tiny, chunks):
    model, _ = tiny
    ids = torch.randint(3, 300, (sum(chunks),), generator=torch.Generator().manual_seed(2)).tolist()
    expected = PagedRunner(model).step([("a", ids)])[0]
    runner, start = PagedRunner(model, seed=5), 0
    for n in chunks:
        logits = runner.step([("a", ids[start : start + n])])[0]
        start += n
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_mixed_batch_matches_sequences_run_alone(tiny):
    """Decodes of different lengths, a first prefill chunk and a later one, in one forward."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 33, 17, 60, 12, 48)]
    alone = [PagedRunner(model).step([(0, p)])[0] for p in prompts]

    runner = PagedRunner(model, seed=9)
    # sequences 0-3 are decoding (their last token still to feed), 4 starts its prefill, 5 is mid-prefill
    runner.step([(i, prompts[i][:-1]) for i in range(4)] + [(5, prompts[5][:20])])
    work = [
        (3, prompts[3][-1:]),
        (4, prompts[4]),
        (0, prompts[0][-1:]),
        (5, prompts[5][20:]),
        (2, prompts[2][-1:]),
        (1, prompts[1][-1:]),
    ]
    logits = runner.step(work)
    for (seq, _), row in zip(work, logits, strict=True):
        torch.testing.assert_close(row, alone[seq], atol=1e-5, rtol=1e-5, msg=f"sequence {seq}")


def test_many_decodes_of_different_lengths_in_one_step(tiny):
    """More decodes than one attention chunk holds, in an order unsorted by length."""
    model, _ = tiny
    gen = torch.Generator().manual_seed(4)
    lengths = [int(n) for n in torch.randint(2, 90, (21,), generator=gen)]
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]
    alone = [PagedRunner(model).step([(0, p)])[0] for p in prompts]
    runner = PagedRunner(model, num_blocks=1024, seed=11)
    runner.step([(i, p[:-1]) for i, p in enumerate(prompts)])
    logits = runner.step([(i, p[-1:]) for i, p in enumerate(prompts)])
    # decodes take the fixed-order kernel, the prompts alone SDPA: float32 rounding apart
    torch.testing.assert_close(logits, torch.stack(alone), atol=1e-4, rtol=1e-4)


def test_bf16_matmuls_stay_close(tmp_path):
    checkpoint = load_hf_dir(write_tiny_llama(tmp_path))
    fp32 = LlamaModel(checkpoint.config, checkpoint.weights)
    mixed = LlamaModel(checkpoint.config, checkpoint.weights, matmul_dtype=torch.bfloat16)
    bf16 = LlamaModel(checkpoint.config, checkpoint.weights, dtype=torch.bfloat16)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    expected = PagedRunner(fp32).step([("a", ids)])[0]
    scale = expected.abs().max()
    for model in (mixed, bf16):
        got = PagedRunner(model).step([("a", ids)])[0]
        assert got.dtype == torch.float32
        assert (got - expected).abs().max() < 0.05 * scale


def test_bf16_kv_cache_with_fp32_weights(tiny):
    model, _ = tiny
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = PagedRunner(model).step([("a", ids)])[0]
    got = PagedRunner(model, kv_dtype=torch.bfloat16).step([("a", ids)])[0]
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    from transformers import LlamaForCausalLM

    path = write_tiny_llama(tmp_path, rope_scaling=scaling, rope_theta=10000.0)
    checkpoint = load_hf_dir(path)
    assert checkpoint.config.rope_scaling["rope_type"] == scaling["rope_type"]
    model = LlamaModel(checkpoint.config, checkpoint.weights)
    reference = LlamaForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(
        PagedRunner(model).step([("a", ids)])[0], theirs, atol=1e-4, rtol=1e-4
    )


def test_rope_inv_freq_default_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(hidden_size=576, num_attention_heads=9, rope_theta=100000.0)
    config = ModelConfig.from_hf(hf.to_dict())
    torch.testing.assert_close(
        rope_inv_freq(config), LlamaRotaryEmbedding(hf).inv_freq, atol=0, rtol=0
    )


def test_kv_cache_layout():
    config = ModelConfig(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    cache = allocate_kv_cache(config, num_blocks=7, block_size=4)
    assert len(cache) == 3
    assert cache[0].shape == (7, 4, 2, 2, 16) and not cache[0].any()


# --- the bundled model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_block_model(bundled_checkpoint):
    """The bundled model with every matmul reading the GGUF's Q4_1/Q8_0 blocks (the
    batch-invariant mode runs them at every row count; the default mode at few rows)."""
    model = LlamaModel(bundled_checkpoint.config, bundled_checkpoint.weights,
                       quantized=bundled_checkpoint.quantized, batch_invariant=True)
    assert model.weights_format == "gguf Q4_1+Q8_0 blocks"
    return model


# the dense float32 model, and the one reading the GGUF blocks
MODELS = ["bundled_model", "bundled_block_model"]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
def test_first_step_logits_match_transformers(bundled_checkpoint, model_name, hf_model,
                                              request):
    bundled_model = request.getfixturevalue(model_name)
    tokenizer = bundled_checkpoint.tokenizer
    for prompt in CHAT_PROMPTS[:4]:
        ids = tokenizer.encode_chat(chat(prompt))
        ours = PagedRunner(bundled_model).step([("a", ids)])[0]
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0, -1]
        assert (ours - theirs).abs().max() < 1e-3, prompt
        assert int(ours.argmax()) == int(theirs.argmax())


@pytest.fixture(scope="module")
def hf_continuations(bundled_checkpoint, hf_model) -> list[list[int]]:
    """transformers' 64 greedy tokens for each chat prompt, generated as one left-padded batch
    (once for both models under test: the reference does not depend on them)."""
    tokenizer = bundled_checkpoint.tokenizer
    eos = tokenizer.eos_token_ids
    prompts = [tokenizer.encode_chat(chat(p)) for p in CHAT_PROMPTS]
    width = max(len(p) for p in prompts)
    pad = eos[0]
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        generated = hf_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=pad,
        )[:, width:]
    return [row.tolist() for row in generated]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
def test_greedy_continuations_match_transformers(bundled_checkpoint, model_name,
                                                 hf_continuations, request):
    """20 chat prompts, 64 greedy tokens each, all generated together with chunked prefills that
    share steps with decodes, against transformers' continuations."""
    bundled_model = request.getfixturevalue(model_name)
    tokenizer = bundled_checkpoint.tokenizer
    eos = tokenizer.eos_token_ids
    prompts = [tokenizer.encode_chat(chat(p)) for p in CHAT_PROMPTS]
    ours, mixed_steps = greedy_generate(
        bundled_model, prompts, 64, eos, prefill_chunk=24, token_budget=96
    )
    assert mixed_steps > 0
    same = [
        until_eos(o, eos) == until_eos(t, eos)
        for o, t in zip(ours, hf_continuations, strict=True)
    ]
    assert all(same), [CHAT_PROMPTS[i] for i, s in enumerate(same) if not s]
    assert tokenizer.decode(ours[0]).strip().startswith("The capital of France is Paris")


@pytest.mark.slow
@pytest.mark.skipif(not native_bf16(), reason="this CPU has no AVX512-BF16 or AMX: the engine "
                    "runs float32 matmuls here, so it has no bf16 path to compare")
def test_bf16_path_is_as_close_to_float32_as_transformers_in_bf16(
        bundled_checkpoint, hf_model):
    """What the engine runs on this CPU (bf16 matmuls and KV cache, float32 accumulation and
    residual stream) against transformers run in bf16 on the same weights: its logits are no
    farther from the float32 reference than transformers' own, and pick the same tokens."""
    import copy

    engine_bf16 = LlamaModel(bundled_checkpoint.config, bundled_checkpoint.weights,
                             matmul_dtype=default_matmul_dtype(torch.float32))
    assert engine_bf16.matmul_dtype == torch.bfloat16
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    tokenizer = bundled_checkpoint.tokenizer
    for prompt in CHAT_PROMPTS[:2]:
        ids = tokenizer.encode_chat(chat(prompt))
        ours = PagedRunner(engine_bf16, kv_dtype=torch.bfloat16).step([("a", ids)])[0]
        with torch.no_grad():
            reference = hf_model(torch.tensor([ids])).logits[0, -1]
            theirs = hf_bf16(torch.tensor([ids])).logits[0, -1].float()
        ours_error = (ours - reference).abs().max()
        theirs_error = (theirs - reference).abs().max()
        print(f"{prompt!r}: max |logit - float32| engine bf16 {ours_error:.3f}, "
              f"transformers bf16 {theirs_error:.3f}")
        assert ours_error <= theirs_error, prompt
        assert int(ours.argmax()) == int(theirs.argmax()) == int(reference.argmax()), prompt


@pytest.mark.slow
def test_bundled_chunked_prefill_and_mixed_batch(bundled_checkpoint, bundled_model):
    tokenizer = bundled_checkpoint.tokenizer
    a, b, c = (tokenizer.encode_chat(chat(p)) for p in CHAT_PROMPTS[:3])
    alone = [PagedRunner(bundled_model).step([(0, p)])[0] for p in (a, b, c)]

    runner = PagedRunner(bundled_model, seed=3)
    runner.step([("a", a[:-1]), ("b", b[:10])])
    runner.step([("b", b[10:25])])
    logits = runner.step([("a", a[-1:]), ("b", b[25:]), ("c", c)])
    for row, expected in zip(logits, alone, strict=True):
        assert (row - expected).abs().max() < 1e-4


def test_dense_matmul_path_matches_packed(tmp_path, monkeypatch):
    """Where oneDNN packing is unavailable (GPU, other builds) the model uses F.linear."""
    checkpoint = load_hf_dir(write_tiny_llama(tmp_path))
    packed = LlamaModel(checkpoint.config, checkpoint.weights)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    dense = LlamaModel(checkpoint.config, checkpoint.weights)
    assert packed.layers[0].qkv.packed is not None and dense.layers[0].qkv.packed is None
    ids = list(range(3, 40))
    torch.testing.assert_close(
        PagedRunner(dense).step([("a", ids)]),
        PagedRunner(packed).step([("a", ids)]),
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.slow
def test_gguf_blocks_are_the_dense_weights_in_the_models_layout(bundled_checkpoint,
                                                                bundled_block_model):
    """The loader's blocks, fused as the model fuses them, compute what the dense weights do:
    Q and K rows in the model's RoPE layout (llama.cpp's, as stored), the tied head from the
    Q8_0 embedding."""
    from engine.model import _interleave_rope_rows

    c, w = bundled_checkpoint.config, bundled_checkpoint.weights
    p = "model.layers.3."
    qkv = torch.cat([_interleave_rope_rows(w[p + "self_attn.q_proj.weight"], c.num_heads),
                     _interleave_rope_rows(w[p + "self_attn.k_proj.weight"], c.num_kv_heads),
                     w[p + "self_attn.v_proj.weight"]])
    gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
    layer = bundled_block_model.layers[3]
    x = torch.randn(3, c.hidden_size, generator=torch.Generator().manual_seed(0))
    for linear, dense in ((layer.qkv, qkv), (layer.gate_up, gate_up),
                          (bundled_block_model.lm_head, w["model.embed_tokens.weight"])):
        torch.testing.assert_close(linear(x).double(), x.double() @ dense.double().T, rtol=0,
                                   atol=1e-4)
    assert bundled_checkpoint.quantized["model.embed_tokens.weight"].qtype == "Q8_0"
    assert bundled_block_model.decode_weight_bytes < 110e6  # the blocks, not 270 MB of bf16


class _CountedStack:
    """A model's block stack that counts the steps it runs."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("gguf_blocks", [True, False])
def test_block_stack_computes_the_bits_of_the_per_call_layers(bundled_checkpoint,
                                                              batch_invariant, gguf_blocks):
    """The decoder's layers in one kernel call (cpu_kernels.BlockStack) against the same model
    calling each layer's kernels from Python: the same logits, bit for bit, in each step it
    takes -- decode steps of few rows, and in batch-invariant mode every step. Its matmuls: the
    GGUF blocks, or the bf16 kernel where the CPU has one (every row in batch-invariant mode,
    every row of a model without blocks)."""
    from engine import cpu_kernels

    if not gguf_blocks and not cpu_kernels.bf16_linear_supported():
        pytest.skip("this CPU has no AVX512-BF16 or AMX: a model without GGUF blocks runs its "
                    "matmuls on oneDNN, so no step runs the stack")
    model = LlamaModel(bundled_checkpoint.config, bundled_checkpoint.weights,
                       matmul_dtype=default_matmul_dtype(torch.float32),
                       quantized=bundled_checkpoint.quantized if gguf_blocks else None,
                       batch_invariant=batch_invariant)
    counted = [(rows, _CountedStack(stack)) for rows, stack in model.block_stacks]
    assert counted
    tokenizer = bundled_checkpoint.tokenizer
    a, b, c = (tokenizer.encode_chat(chat(p)) for p in CHAT_PROMPTS[:3])
    steps = [[("a", a), ("b", b[:20])], [("a", [7]), ("b", b[20:])], [("a", [9]), ("b", [11])],
             [("a", [13]), ("b", [15]), ("c", c[:5])]] + [[(s, [t]) for s in "abc"]
                                                          for t in (17, 19)]
    by_stack, by_calls = PagedRunner(model), PagedRunner(model)
    for work in steps:
        model.block_stacks = counted
        ours = by_stack.step(work)
        model.block_stacks = []
        assert torch.equal(ours, by_calls.step(work)), work
    # default mode: the three steps of decodes alone; batch-invariant mode: all six
    assert sum(stack.calls for _, stack in counted) == (6 if batch_invariant else 3)


@pytest.mark.slow
def test_batch_invariant_steps_of_few_rows_read_the_blocks_for_the_bf16_kernels_bits(
        bundled_checkpoint):
    """Batch-invariant mode on AVX512-BF16 (not AMX, whose bits differ): decode steps of few
    rows read the GGUF blocks as bf16 products (cpu_kernels.BlockBf16Linear), the others the
    bf16 kernel, and every step's logits are those of the model without the blocks, bit for bit."""
    from engine import cpu_kernels

    if cpu_kernels.bf16_linear_paths()[:1] != ["avx512"]:
        pytest.skip("the bf16 kernel here is not AVX512-BF16's (AMX, or no bf16 instructions): "
                    "batch-invariant mode reads no blocks")
    c, w = bundled_checkpoint.config, bundled_checkpoint.weights
    reading = LlamaModel(c, w, matmul_dtype=torch.bfloat16, batch_invariant=True,
                         quantized=bundled_checkpoint.quantized)
    dense = LlamaModel(c, w, matmul_dtype=torch.bfloat16, batch_invariant=True)
    assert reading.weights_format.startswith("gguf Q4_1+Q8_0 blocks as bf16 up to")
    assert reading.decode_weight_bytes < 110e6 < 250e6 < dense.decode_weight_bytes
    (few_rows, blocks_stack), _ = reading.block_stacks
    counted = _CountedStack(blocks_stack)
    reading.block_stacks[0] = (few_rows, counted)
    tokenizer = bundled_checkpoint.tokenizer
    a, b = (tokenizer.encode_chat(chat(p)) for p in CHAT_PROMPTS[:2])
    steps = [[("a", a), ("b", b)]] + [[(s, [t]) for s in "ab"] for t in (17, 19, 23)]
    by_blocks, by_dense = PagedRunner(reading), PagedRunner(dense)
    for work in steps:
        assert torch.equal(by_blocks.step(work), by_dense.step(work)), work
    assert counted.calls == 3  # the decode steps


def test_zen4_is_told_by_vendor_and_family():
    """Zen 4 reads the blocks as bf16 for fewer rows: told from /proc/cpuinfo's first processor."""
    def cpuinfo(vendor, family):
        return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                f"model\t\t: 17\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n")

    assert cpu_is_zen4(cpuinfo("AuthenticAMD", 25))
    assert not cpu_is_zen4(cpuinfo("AuthenticAMD", 26))  # Zen 5
    assert not cpu_is_zen4(cpuinfo("GenuineIntel", 25))
    assert not cpu_is_zen4("")


@pytest.mark.slow
def test_with_batch_invariance_off_steps_past_the_float32_blocks_read_them_as_bf16(
        bundled_checkpoint):
    """Batch-invariant mode off, on AVX512-BF16: the fewest rows run float32 products on the
    blocks, then up to block_bf16_max_rows() the blocks as bf16 products (the bf16 kernel's bits),
    then the bf16 kernel; a block stack for each."""
    from engine import cpu_kernels

    if cpu_kernels.bf16_linear_paths()[:1] != ["avx512"]:
        pytest.skip("the bf16 kernel here is not AVX512-BF16's (AMX, or no bf16 instructions)")
    c, w = bundled_checkpoint.config, bundled_checkpoint.weights
    reading = LlamaModel(c, w, matmul_dtype=torch.bfloat16,
                         quantized=bundled_checkpoint.quantized)
    dense = LlamaModel(c, w, matmul_dtype=torch.bfloat16)
    float32_rows, as_bf16_rows = BLOCK_MAX_ROWS["bf16 kernel"], block_bf16_max_rows()
    assert reading.weights_format == (f"gguf Q4_1+Q8_0 blocks up to {float32_rows} rows, "
                                      f"as bf16 up to {as_bf16_rows}, bfloat16 above")
    assert [rows for rows, _ in reading.block_stacks] == [float32_rows, as_bf16_rows, math.inf]
    tokenizer = bundled_checkpoint.tokenizer
    prompts = {i: tokenizer.encode_chat(chat(CHAT_PROMPTS[i % len(CHAT_PROMPTS)]))
               for i in range(as_bf16_rows)}
    by_blocks, by_dense = PagedRunner(reading), PagedRunner(dense)
    # the prompts (past both limits: the bf16 kernel), then a decode each (the blocks as bf16)
    for work in (list(prompts.items()), [(i, [17]) for i in prompts]):
        assert torch.equal(by_blocks.step(work), by_dense.step(work))
