"""The fixed-order paged-attention kernel (engine/csrc/fixed_order_attention.cpp) on its own.

Its vectorized implementation must compute the portable one's bits exactly (one arithmetic,
two codings), both must be attention (against a float64 dense reference), and a row's bits must
not depend on the other rows of the call.
"""

import pytest
import torch

from engine import fixed_order_attention as kernel

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C++ compiler for the kernel")


def paged_case(seed, *, heads, kv_heads, head_dim, block_size, positions, dtype):
    """q for one query row per sequence, each sequence's keys 0..position scattered over a
    shuffled paged cache that also holds other (finite) data."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [p // block_size + 1 for p in positions]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(positions), max(per_seq)), -1, dtype=torch.int32)
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(positions), heads * head_dim, generator=g)
    return q, cache, tables, torch.arange(len(positions), dtype=torch.int32), torch.tensor(
        positions, dtype=torch.int64)


def dense_reference(q, cache, tables, seq, positions):
    """Plain float64 softmax attention of each row over its keys 0..position."""
    block_size, kv_heads, head_dim = cache.shape[1], cache.shape[3], cache.shape[4]
    heads = q.shape[1] // head_dim
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        n = int(positions[r]) + 1
        blocks = tables[seq[r], : (n + block_size - 1) // block_size].long()
        kv = cache[blocks].reshape(-1, 2, kv_heads, head_dim)[:n].double()
        k = kv[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, D]
        v = kv[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        qr = q[r].double().view(heads, head_dim)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", qr, k) * head_dim**-0.5, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, v).reshape(-1)
    return out


SHAPES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2-135M
    (8, 2, 128, 16),  # Llama 3 style groups of 4, head size 128
    (4, 4, 64, 8),  # no grouping, small blocks
    (6, 2, 32, 32),  # a head size only the portable code takes
]
POSITIONS = [0, 1, 14, 15, 16, 17, 31, 47, 200, 333]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_matches_float64_attention(dtype, heads, kv_heads, head_dim, block_size):
    case = paged_case(0, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, positions=POSITIONS, dtype=dtype)
    expected = dense_reference(*case)
    for portable in (False, True):
        out = kernel.paged_attention(*case, head_dim**-0.5, portable=portable)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.skipif(not kernel.vectorized(), reason="this CPU's build has no AVX-512 code")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_vectorized_code_computes_the_portable_bits(dtype, heads, kv_heads, head_dim, block_size):
    for seed in range(3):
        case = paged_case(seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          block_size=block_size, positions=POSITIONS, dtype=dtype)
        fast = kernel.paged_attention(*case, head_dim**-0.5)
        portable = kernel.paged_attention(*case, head_dim**-0.5, portable=True)
        assert torch.equal(fast, portable)


def test_a_row_does_not_depend_on_the_other_rows():
    q, cache, tables, seq, positions = paged_case(
        1, heads=9, kv_heads=3, head_dim=64, block_size=16, positions=POSITIONS,
        dtype=torch.bfloat16)
    together = kernel.paged_attention(q, cache, tables, seq, positions, 0.125)
    for r in range(q.shape[0]):
        alone = kernel.paged_attention(q[r : r + 1], cache, tables, seq[r : r + 1],
                                       positions[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r])
    # strided rows (a slice of a wider projection, as the model passes them) read the same
    wide = torch.cat([q, torch.randn(q.shape)], dim=1)[:, : q.shape[1]]
    assert torch.equal(kernel.paged_attention(wide, cache, tables, seq, positions, 0.125),
                       together)
