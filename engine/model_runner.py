"""Pack the scheduled tokens into one ForwardBatch, run the model, sample.

Everything is built as Python lists and turned into tensors once per step: on a 2-core CPU the
per-step overhead is paid by every request in the batch.
"""

import dataclasses
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.sampler import Sampler, token_logprobs
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


def pack(batch: ScheduledBatch, block_size: int) -> tuple[ForwardBatch, list[Sequence]]:
    """The forward batch of this step, and the sequences that sample a token from it (those
    whose scheduled tokens reach their last known token), in batch order."""
    sampling: list[Sequence] = []
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    tables: list[list[int]] = []
    max_query_len = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        if n == 1:
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            for b in range(start // block_size, (end - 1) // block_size + 1):
                first = b * block_size
                base = table[b] * block_size - first
                slots.extend(range(base + max(start, first), base + min(end, first + block_size)))
        query_start.append(query_start[-1] + n)
        context_lens.append(end)
        tables.append(table)
        if end == seq.num_tokens:  # the chunk reaches the last known token: sample from it
            logits_indices.append(query_start[-1] - 1)
            sampling.append(seq)
        max_query_len = max(max_query_len, n)
    width = max(len(t) for t in tables)
    forward_batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start=torch.tensor(query_start, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        max_query_len=max_query_len,
        max_context_len=max(context_lens),
    )
    return forward_batch, sampling


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    from engine.model import default_kv_cache_dtype

    return default_kv_cache_dtype(config.kv_cache_dtype, getattr(torch, config.dtype),
                                  config.device)


def kv_cache_blocks(config: EngineConfig, model_config) -> int:
    """How many KV blocks the config gives a model: `num_kv_blocks`, or as many as
    `kv_cache_bytes` holds."""
    from engine.model import kv_cache_bytes_per_block

    return config.num_kv_blocks or config.kv_cache_bytes // kv_cache_bytes_per_block(
        model_config, config.block_size, kv_cache_dtype(config))


class ModelRunner:
    """Holds the model and its KV cache. `model.forward(batch, kv_cache)` returns logits for
    the rows in `batch.logits_indices`."""

    def __init__(self, model, kv_cache, block_size: int, num_kv_blocks: int,
                 device: str = "cpu", vocab_size: int | None = None,
                 eos_token_ids: tuple[int, ...] | list[int] = ()):
        """`model.forward(ForwardBatch, kv_cache) -> logits`; `kv_cache` is whatever the model
        reads and writes, sized for `num_kv_blocks` blocks of `block_size` tokens;
        `vocab_size` (when known) bounds the token ids a request may bring; `eos_token_ids`
        are masked while a request is below its min_tokens."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.sampler = Sampler(eos_token_ids)
        # Called with the sampling sequences and their logits at every step (tests and benches
        # that compare logits bit for bit); None in serving.
        self.logits_hook: Callable[[list[Sequence], torch.Tensor], None] | None = None

    @classmethod
    def from_checkpoint(cls, checkpoint, config: EngineConfig) -> "ModelRunner":
        """The Llama model of a loaded checkpoint, with a KV cache sized by the config."""
        from engine.model import LlamaModel, default_matmul_dtype

        dtype = getattr(torch, config.dtype)
        limit = checkpoint.config.max_position_embeddings
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {limit}")
        model = LlamaModel(checkpoint.config, checkpoint.weights, dtype=dtype,
                           device=config.device,
                           matmul_dtype=default_matmul_dtype(dtype, config.device),
                           batch_invariant=config.batch_invariant,
                           quantized=checkpoint.quantized)
        num_blocks = kv_cache_blocks(config, checkpoint.config)
        kv_cache = model.allocate_kv_cache(num_blocks, config.block_size, kv_cache_dtype(config))
        return cls(model, kv_cache, config.block_size, num_blocks, config.device,
                   checkpoint.config.vocab_size,
                   getattr(checkpoint.tokenizer, "eos_token_ids", None) or ())

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """One token for every sequence whose scheduled tokens reach its last known token, in
        batch order; sequences in the middle of a prefill get none."""
        forward_batch, sampling = pack(batch, self.block_size)
        if self.device.type != "cpu":  # packed on the host, copied once per step
            forward_batch = dataclasses.replace(forward_batch, **{
                f.name: getattr(forward_batch, f.name).to(self.device, non_blocking=True)
                for f in dataclasses.fields(forward_batch)
                if isinstance(getattr(forward_batch, f.name), torch.Tensor)})
        logits = self.model.forward(forward_batch, self.kv_cache)
        if not sampling:
            return []
        if self.logits_hook is not None:
            self.logits_hook(sampling, logits)
        tokens = self.sampler(
            logits,
            [s.params for s in sampling],
            [s.seed for s in sampling],
            [s.num_output_tokens for s in sampling],
            [(s.token_ids, s.num_prompt_tokens) for s in sampling],
        )
        wanted = [i for i, s in enumerate(sampling)  # a failed row (-1) has no logprobs
                  if s.params.logprobs is not None and tokens[i] >= 0]
        if wanted:  # each sequence keeps its tokens' logprobs, in output order
            found = token_logprobs(logits[wanted], [tokens[i] for i in wanted],
                                   [sampling[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, found, strict=True):
                sampling[i].logprobs.append(entry)
        return tokens
