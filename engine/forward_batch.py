"""The one small object a forward pass needs: which tokens run this step and where their KV lives.

The scheduler decides *which* tokens run; the model runner packs them into a ForwardBatch; the
model reads and writes the paged KV cache through it. A step may mix decode tokens (one query
token per sequence) and prefill chunks (many query tokens per sequence) in one pass.

Tokens are flattened across sequences in batch order: sequence i owns the query rows
``query_start[i] : query_start[i + 1]``.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the query tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each query token in its sequence
    query_start: torch.Tensor  # [B + 1] int32, prefix sums of query lengths
    context_lens: torch.Tensor  # [B] int32, KV length of each sequence *after* this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical block ids, padded with -1
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset) per token
    logits_indices: torch.Tensor  # [B'] int64, rows of T whose logits the sampler needs
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
