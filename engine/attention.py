"""Paged attention over the KV cache, for a batch that mixes decodes and prefill chunks.

Cache layout, one tensor per layer: ``[num_blocks, block_size, 2, num_kv_heads, head_dim]``.
A token's K and V sit side by side in its slot (``block * block_size + offset``), so writing a
step's new K/V is one ``index_copy_`` of ``[T, 2 * kv_width]`` rows, and a block is one contiguous
chunk (cheap to copy between workers).

Reading goes through an :class:`AttentionPlan`, built once per forward and shared by every layer.
Two kernels:

* the fixed-order kernel (engine/csrc/fixed_order_attention.cpp, CPU): reads the paged cache in
  place, one query row at a time, in an order that depends on the row's position only. It takes
  the decode rows (faster than gathering for SDPA: no copy, no padding) and, in batch-invariant
  mode, every row -- that is what makes a token's output independent of its companions and of
  its prompt's chunk boundaries.
* torch SDPA (or xformers on CUDA) over gathered blocks, for prefill chunks (many queries share
  each key: a matmul wins) and for decodes where the fixed-order kernel is unavailable. For each
  chunk of sequences: the physical blocks to gather (whole blocks: one contiguous copy each) and
  the mask "key position <= query position", as an additive bias. Decodes are sorted by context
  length, up to ``DECODE_CHUNK_SEQS`` per call; each multi-token prefill chunk goes on its own
  and sees its sequence's cached prefix and, causally, itself. Grouped-query attention costs no
  copy of K/V: the query heads sharing a KV head become that head's query rows. Here a row's
  bits can depend on its companions through the padded key length of its chunk (masked keys
  add exact zeros, but the kernel's blocking of the reduction changes with the length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from engine import huge_pages
from engine.forward_batch import ForwardBatch

# attend(q [N, kv_heads, Mq, D], k [N, kv_heads, Mk, D], v, bias [N, 1, Mq, Mk]) -> [N, kv_heads, Mq, D]
# bias is additive, in q's dtype: 0 where a query may attend a key, -inf where it may not.
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# fixed(q [R, heads * D], cache, block_tables [B, max] int32, row_seq [R] int32,
#       positions [R] int64, scale) -> [R, heads * D]; see engine/cpu_kernels.py
FixedFn = Callable[..., torch.Tensor]

# Which rows the fixed-order kernel attends.
FIXED_NONE, FIXED_DECODES, FIXED_ALL = "none", "decodes", "all"


def allocate_kv_cache(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One zeroed ``[num_blocks, block_size, 2, num_kv_heads, head_dim]`` tensor per layer.

    Zeroed, not empty: padded key slots are masked out, and 0 * garbage could be NaN. On a
    Linux CPU the tensors sit on transparent huge pages where the kernel allows it.
    """
    shape = (num_blocks, block_size, 2, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        return [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _torch_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _xformers_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    import xformers.ops as xops

    n, heads, mq, mk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    # xformers wants the bias per head, its last dim allocated to a multiple of 8.
    padded = (mk + 7) // 8 * 8
    per_head = torch.empty(n, heads, mq, padded, dtype=q.dtype, device=q.device)[..., :mk]
    per_head.copy_(bias.expand(n, heads, mq, mk))
    out = xops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=per_head
    )
    return out.transpose(1, 2)


def select_attend(device: torch.device) -> tuple[str, AttendFn]:
    """The attention kernel for ``device``: xformers on CUDA when importable, else torch SDPA."""
    if device.type == "cuda":
        try:
            import xformers.ops  # noqa: F401
        except ImportError:
            pass
        else:
            return "xformers", _xformers_attend
    return "torch-sdpa", _torch_attend


# Decodes are attended in chunks of at most this many sequences, sorted by context length: each
# chunk is padded only to its own longest context, and its gathered K/V (a few MB) stay in cache
# between the gather and the SDPA that reads them; smaller chunks cost more ops per layer.
# Measured on 2 Zen 3 cores, whole decode step of SmolLM2-135M, 64 sequences with contexts of
# 128-640 tokens on scattered blocks (min of runs, noisy machine): chunks of 1: 716 ms, 2: 515,
# 4: 465-507, 8: 523-829, 16: 1192, all 64 in one: 1749. With 16 sequences: 2-4 best (~165 ms).
DECODE_CHUNK_SEQS = 4


@dataclass(slots=True)
class _Chunk:
    """Sequences attended by one SDPA call."""

    blocks: torch.Tensor  # [N * num_blocks] physical block ids to gather, N sequences in a row
    bias: torch.Tensor  # [N, 1, Mq, keys] additive: 0 = may attend, -inf = may not
    num_seqs: int
    keys: int  # num_blocks * block_size: padded to whole blocks, the mask hides the tail


@dataclass(slots=True)
class _Prefill:
    rows: slice
    chunk: _Chunk
    query_len: int


@dataclass(slots=True)
class _FixedRows:
    """Rows for the fixed-order kernel."""

    rows: slice | torch.Tensor
    seq: torch.Tensor  # [R] int32, each row's sequence (a row of block_tables)
    positions: torch.Tensor  # [R] int64


@dataclass(slots=True)
class AttentionPlan:
    decode_rows: slice | torch.Tensor | None  # query rows of the SDPA decodes, in chunk order
    decode_chunks: list[_Chunk]
    prefills: list[_Prefill]
    num_tokens: int
    fixed: _FixedRows | None
    block_tables: torch.Tensor


def _chunk(
    block_tables: torch.Tensor,
    context_lens: list[int],
    query_positions: torch.Tensor,
    block_size: int,
    group: int,
    dtype: torch.dtype,
) -> _Chunk:
    """block_tables [N, max_blocks]; query_positions [N, Mq]; masks key position <= query position.

    The mask is built once per step as the additive bias SDPA applies (a boolean mask is turned
    into one inside every call: 20% of a prefill chunk's attention, 128 queries x 512 keys).
    """
    num_blocks = (max(context_lens) + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].clamp(min=0).reshape(-1)
    keys = num_blocks * block_size
    key_positions = torch.arange(keys, device=block_tables.device)
    hidden = key_positions > query_positions[:, :, None]  # [N, Mq, keys]
    if group > 1:  # the query heads of one KV head are stacked as `group` copies of the rows
        hidden = hidden.repeat(1, group, 1)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    bias.masked_fill_(hidden, float("-inf"))
    return _Chunk(blocks, bias.unsqueeze(1), len(context_lens), keys)


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when the rows are contiguous (a view, no copy), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def build_plan(
    batch: ForwardBatch,
    block_size: int,
    group: int,
    fixed: str = FIXED_NONE,
    dtype: torch.dtype = torch.float32,
) -> AttentionPlan:
    """Everything attention needs that is the same for every layer of this step. ``fixed``
    names the rows the fixed-order kernel takes (FIXED_NONE, FIXED_DECODES or FIXED_ALL);
    ``dtype`` is the queries' (SDPA's masks are built in it)."""
    device = batch.input_ids.device
    starts = batch.query_start.tolist()
    query_lens = [e - s for s, e in pairwise(starts)]
    context_lens = batch.context_lens.tolist()
    if fixed == FIXED_ALL:
        seq = torch.repeat_interleave(
            torch.arange(len(query_lens), dtype=torch.int32, device=device),
            torch.tensor(query_lens, device=device),
        )
        rows = _FixedRows(slice(0, starts[-1]), seq, batch.positions)
        return AttentionPlan(None, [], [], starts[-1], rows, batch.block_tables)

    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    fixed_rows = None
    if decodes and fixed == FIXED_DECODES:
        # no chunks to pad: batch order, often one contiguous slice
        rows = _rows([starts[i] for i in decodes], device)
        seq = torch.tensor(decodes, dtype=torch.int32, device=device)
        fixed_rows = _FixedRows(rows, seq, batch.positions[rows])
        decodes = []
    decodes.sort(key=lambda i: context_lens[i])  # SDPA chunks pad to their longest context

    decode_rows = None
    decode_chunks = []
    if decodes:
        decode_rows = _rows([starts[i] for i in decodes], device)
        positions = batch.positions[decode_rows].view(-1, 1)
        for first in range(0, len(decodes), DECODE_CHUNK_SEQS):
            seqs = decodes[first : first + DECODE_CHUNK_SEQS]
            tables = batch.block_tables[torch.tensor(seqs, device=device)]
            decode_chunks.append(
                _chunk(
                    tables,
                    [context_lens[i] for i in seqs],
                    positions[first : first + len(seqs)],
                    block_size,
                    1,
                    dtype,
                )
            )

    prefills = []
    for i, n in enumerate(query_lens):
        if n > 1:
            rows = slice(starts[i], starts[i + 1])
            chunk = _chunk(
                batch.block_tables[i : i + 1],
                [context_lens[i]],
                batch.positions[rows].view(1, n),
                block_size,
                group,
                dtype,
            )
            prefills.append(_Prefill(rows, chunk, n))
    return AttentionPlan(
        decode_rows, decode_chunks, prefills, starts[-1], fixed_rows, batch.block_tables
    )


def _gather_kv(
    cache: torch.Tensor, chunk: _Chunk, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a chunk's sequences as [N, kv_heads, keys, head_dim] strided views of one copy.

    Whole blocks are copied (one contiguous run each); K and V are views into that copy, which
    SDPA reads through their strides.
    """
    num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    # on a 2-D view index_select copies whole rows (~25% faster than on the 5-D tensor)
    blocks = cache.view(cache.shape[0], -1).index_select(0, chunk.blocks).to(dtype)
    kv = blocks.view(chunk.num_seqs, chunk.keys, 2, num_kv_heads, head_dim)
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    plan: AttentionPlan,
    attend: AttendFn,
    fixed: FixedFn | None = None,
) -> torch.Tensor:
    """Attention of every query row over its sequence's cached keys.

    q: [T, heads * head_dim], RoPE applied. The step's own K/V must already be in ``cache``.
    ``fixed`` is the fixed-order kernel, needed when the plan gives it rows. SDPA runs in q's
    dtype (a cache of another dtype is converted as it is gathered). Returns
    [T, heads * head_dim] in q's dtype.
    """
    num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    width = q.shape[1]
    group = width // head_dim // num_kv_heads
    parts: list[tuple[slice | torch.Tensor, torch.Tensor]] = []  # (rows, their output)
    if plan.fixed is not None:
        f = plan.fixed
        parts.append((f.rows, fixed(q[f.rows], cache, plan.block_tables, f.seq, f.positions,
                                    head_dim**-0.5)))
    if plan.decode_chunks:
        q_dec = q[plan.decode_rows].view(-1, num_kv_heads, group, head_dim)
        outs, first = [], 0
        for chunk in plan.decode_chunks:
            k, v = _gather_kv(cache, chunk, q.dtype)
            outs.append(attend(q_dec[first : first + chunk.num_seqs], k, v, chunk.bias))
            first += chunk.num_seqs
        decoded = outs[0] if len(outs) == 1 else torch.cat(outs)
        parts.append((plan.decode_rows, decoded.view(-1, width)))
    if len(parts) == 1 and not plan.prefills:
        rows, out = parts[0]
        if isinstance(rows, slice) and rows == slice(0, plan.num_tokens):
            return out  # every row, in row order: nothing to scatter

    out = q.new_empty(plan.num_tokens, width)
    for rows, part in parts:
        out[rows] = part
    for p in plan.prefills:
        n = p.query_len
        k, v = _gather_kv(cache, p.chunk, q.dtype)
        # [n, kv_heads, group, D] -> [1, kv_heads, group * n, D]
        q_pre = q[p.rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_pre = q_pre.reshape(1, num_kv_heads, group * n, head_dim)
        o = attend(q_pre, k, v, p.chunk.bias).view(num_kv_heads, group, n, head_dim)
        out[p.rows] = o.permute(2, 0, 1, 3).reshape(n, width)
    return out
