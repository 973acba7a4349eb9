"""A toy model for engine tests that need no weights, yet catch every paging mistake.

Its "KV cache" stores the token id written at each slot; the next token is a hash of the whole
context *as read back through the block table*. A wrong slot, a wrong block table, a shared
block overwritten, or a preempted request that resumes with stale KV all change the output,
which `reference_greedy` computes directly from the token list.
"""

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner

VOCAB = 97


def next_token(context: list[int]) -> int:
    h = 17
    for position, token in enumerate(context):
        h = (h * 1_000_003 + token * 31 + position) % 2_147_483_647
    return h % VOCAB


def reference_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class ToyModel:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.calls: list[tuple[int, int]] = []  # (num tokens, num logits rows) per forward

    def forward(self, batch, kv_cache: torch.Tensor) -> torch.Tensor:
        flat = kv_cache.view(-1)
        flat[batch.slot_mapping] = batch.input_ids
        query_start = batch.query_start.tolist()
        rows = batch.logits_indices.tolist()
        self.calls.append((len(batch.input_ids), len(rows)))
        logits = torch.empty(len(rows), VOCAB)
        for r, row in enumerate(rows):
            i = next(i for i in range(batch.num_seqs) if query_start[i + 1] - 1 == row)
            length = int(batch.context_lens[i])
            num_blocks = -(-length // self.block_size)
            blocks = batch.block_tables[i, :num_blocks].long()
            context = kv_cache[blocks].reshape(-1)[:length].tolist()
            target = next_token(context)
            # A peaked but smooth distribution: sampling has real choices to make.
            distance = (torch.arange(VOCAB) - target) % VOCAB
            logits[r] = -0.25 * distance.float()
        return logits


def toy_engine(num_kv_blocks: int = 64, registry=None, tokenizer=None, **config) -> LLMEngine:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 128)
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(num_kv_blocks=num_kv_blocks, **config)
    kv_cache = torch.full((num_kv_blocks, cfg.block_size), -1, dtype=torch.int64)
    runner = ModelRunner(ToyModel(cfg.block_size), kv_cache, cfg.block_size, num_kv_blocks)
    return LLMEngine(cfg, runner, tokenizer=tokenizer, registry=registry, model_id="toy")


class CharTokenizer:
    """Token t is the letter chr(97 + t % 26); token 0 is EOS. Enough for stop strings."""

    eos_token_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]

    def detokenizer(self, prompt_ids=()):
        return self

    def step(self, token_id: int) -> str:
        return chr(97 + token_id % 26)
