"""Fixtures and helpers for the model-side engine tests (model, loader, tokenizer).

Import the fixtures you use into the test module (``from engine_fixtures import ...``); the real
model and its transformers reference load once per session.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from unittest import mock

import pytest
import torch

from engine.forward_batch import ForwardBatch
from engine.loader import Checkpoint, load_gguf
from engine.model import LlamaModel
from engine.model_files import bundled_model_path

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "What is 17 * 23?",
    "Give me three tips for learning Python.",
    "Translate 'good morning' into Spanish and German.",
    "Who wrote Pride and Prejudice?",
    "Write a Python function that reverses a string.",
    "What are the primary colors?",
    "Summarize the plot of Romeo and Juliet.",
    "How many days are in a leap year?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system in order.",
    "What does HTTP stand for?",
    "Why is the sky blue?",
    "Suggest a name for a coffee shop.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of green tea? Café ☕ style, please.",
]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def needs_kernels() -> None:
    """Skip (with the reason) where the C++ CPU kernels do not build: batch-invariant mode and
    the bf16 kernel need them. Called inside tests and fixtures, never at collection, so a
    machine without a compiler collects every module."""
    from engine import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels do not build here (no compiler?): batch-invariant mode "
                    "needs them")


# --- the bundled model and its transformers reference -------------------------------------------


@pytest.fixture(scope="session")
def bundled_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def bundled_checkpoint(bundled_cache_dir) -> Checkpoint:
    """The bundled GGUF, loaded cold through a fresh cache folder."""
    return load_gguf(bundled_model_path(), cache_dir=bundled_cache_dir)


@pytest.fixture(scope="session")
def bundled_model(bundled_checkpoint) -> LlamaModel:
    return LlamaModel(bundled_checkpoint.config, bundled_checkpoint.weights)


@pytest.fixture(scope="session")
def hf_model():
    return load_hf_reference_model()


def load_hf_reference_model():
    """transformers' Llama loaded from the bundled GGUF, float32.

    This is what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``
    does for a llama GGUF in transformers 5 (config from the GGUF metadata, tensors through
    ``load_gguf_checkpoint``: dequantize, undo the Q/K permutation), minus its requirement that
    `accelerate` be installed, which the project does not depend on.
    """
    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = bundled_model_path()
    # transformers parses the GGUF twice (config, then tensors) and rebuilds gguf's tensor-name
    # map for each of the model's ~400 submodules: pure functions of their arguments, most of
    # the load's time, so each is computed once here. What transformers computes is unchanged.
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = LlamaForCausalLM(config).float().eval()
        tensors = load_gguf_checkpoint(
            str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = bundled_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- driving the model as the scheduler would ------------------------------------------------


class PagedRunner:
    """Feeds tokens through ``LlamaModel.forward`` with a paged cache whose blocks come from a
    shuffled free list, so no sequence's blocks are contiguous (a test stand-in for the
    scheduler and block manager)."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int = 512,
        block_size: int = 16,
        kv_dtype: torch.dtype | None = None,
        seed: int = 0,
    ):
        self.model = model
        self.block_size = block_size
        self.cache = model.allocate_kv_cache(num_blocks, block_size, kv_dtype)
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.tables: dict[Hashable, list[int]] = {}
        self.computed: dict[Hashable, int] = {}

    def step(self, work: Sequence[tuple[Hashable, Sequence[int]]]) -> torch.Tensor:
        """Feed each sequence its next tokens in one forward; logits of each item's last token."""
        input_ids, positions, slots, context_lens, tables, query_start = [], [], [], [], [], [0]
        for seq, tokens in work:
            start = self.computed.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [
                table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            query_start.append(query_start[-1] + len(tokens))
            context_lens.append(end)
            tables.append(table)
            self.computed[seq] = end
        width = max(len(t) for t in tables)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids),
            positions=torch.tensor(positions),
            query_start=torch.tensor(query_start, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            slot_mapping=torch.tensor(slots),
            logits_indices=torch.tensor(query_start[1:]) - 1,
            max_query_len=max(len(t) for _, t in work),
            max_context_len=max(context_lens),
        )
        return self.model.forward(batch, self.cache)


def greedy_generate(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    prefill_chunk: int = 1 << 30,
    token_budget: int = 1 << 30,
) -> tuple[list[list[int]], int]:
    """Greedy continuations of all prompts at once, scheduled like the engine: every step runs
    all decodes, then prefill chunks of at most ``prefill_chunk`` tokens while ``token_budget``
    lasts. Returns the continuations and how many steps mixed decodes with prefill chunks."""
    runner = PagedRunner(model)
    tokens = [list(p) for p in prompts]
    fed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    mixed_steps = 0
    while not all(done):
        work, items, budget = [], [], token_budget
        for i in range(len(prompts)):
            if not done[i] and fed[i] == len(tokens[i]) - 1 and outputs[i]:
                work.append((i, tokens[i][-1:]))
                items.append(i)
                budget -= 1
        decodes = len(work)
        for i in range(len(prompts)):
            if not done[i] and not outputs[i] and budget > 0:
                n = min(prefill_chunk, len(tokens[i]) - fed[i], budget)
                work.append((i, tokens[i][fed[i] : fed[i] + n]))
                items.append(i)
                budget -= n
        mixed_steps += bool(decodes) and len(work) > decodes
        logits = runner.step(work)
        for (i, chunk), row in zip(work, logits, strict=True):
            fed[i] += len(chunk)
            if fed[i] == len(tokens[i]):
                token = int(row.argmax())
                tokens[i].append(token)
                outputs[i].append(token)
                done[i] = len(outputs[i]) >= max_new_tokens or token in eos_ids
    return outputs, mixed_steps


def until_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return list(tokens[: i + 1])
    return list(tokens)


# --- a tiny random Llama saved as a Hugging Face folder ---------------------------------------


def write_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A random 2-layer GQA Llama as transformers writes it, plus a small byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float().eval()
    with torch.no_grad():  # random init is nearly uniform; larger weights give a peaked softmax
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(sorted(alphabet))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    return path
