"""The C++ CPU kernels (engine/csrc/) on their own.

Every kernel with vectorized implementations (AVX-512, AVX2; engine/csrc/simd.h) must compute
the portable one's bits exactly (one arithmetic, three codings): each path this CPU has is
forced and compared. Fixed-order attention must be attention (against a float64 dense
reference), and a row's bits must not depend on the other rows of the call. Fused layer ops:
the same results as the torch ops they replace (engine/layer_ops.py), row by row.
"""

import itertools
import platform
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels as kernel
from engine.layer_ops import KernelLayerOps, TorchLayerOps

pytestmark = pytest.mark.skipif(not kernel.available(),
                                reason="the C++ kernels do not build here (no compiler?)")

PATHS = ["avx512", "avx2", "portable"]
VECTOR_PATHS = PATHS[:2]


def require(path):
    if path not in kernel.available_paths():
        pytest.skip(f"this CPU has no {path} instructions")


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


def prefill_case(seed, *, heads, kv_heads, head_dim, block_size, dtype):
    """Rows as a mixed step has them: prefill chunks (one sequence's tokens at consecutive
    positions, longer than a run of the kernel, from the start or mid-prompt) beside lone
    decode rows and a short chunk, over a shuffled paged cache."""
    runs = [(0, range(0, 38)), (1, range(100, 131)), (0, range(200, 201)), (2, range(3, 4)),
            (1, range(5, 8))]
    g = torch.Generator().manual_seed(seed)
    per_seq = 210 // block_size + 1
    num_blocks = 3 * per_seq + 2
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: 3 * per_seq].to(torch.int32).view(3, -1)
    seq = torch.tensor([s for s, positions in runs for _ in positions], dtype=torch.int32)
    positions = torch.tensor([p for _, run in runs for p in run], dtype=torch.int64)
    q = torch.randn(len(seq), heads * head_dim, generator=g)
    return q, cache, tables, seq, positions


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
    for path in kernel.available_paths():
        out = kernel.paged_attention(*case, head_dim**-0.5, path=path)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


@pytest.fixture(params=[False, True], ids=["one_block", "blocks_in_turn"])
def decode_read_order(request):
    """Both orders a lone decode can read its keys in, whichever this CPU's default is."""
    before = kernel.set_decode_blocks_in_turn(request.param)
    yield
    kernel.set_decode_blocks_in_turn(before)


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                    reason="reads the x86 vendor id from /proc/cpuinfo")
def test_decodes_read_blocks_in_turn_by_default_on_intel_only():
    vendor = next(line.split(":")[1].strip()
                  for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("vendor_id"))
    before = kernel.set_decode_blocks_in_turn(False)
    kernel.set_decode_blocks_in_turn(before)
    assert before == (vendor == "GenuineIntel")


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_vectorized_attention_computes_the_portable_bits(path, dtype, heads, kv_heads, head_dim,
                                                         block_size, decode_read_order):
    require(path)
    for seed in range(3):
        case = paged_case(seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          block_size=block_size, positions=POSITIONS, dtype=dtype)
        fast = kernel.paged_attention(*case, head_dim**-0.5, path=path)
        portable = kernel.paged_attention(*case, head_dim**-0.5, path="portable")
        assert torch.equal(fast, portable)


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("scale", [30.0, 1e4])
def test_vectorized_softmax_keeps_the_portable_bits_in_the_far_tails(path, scale):
    """Scores far apart: most weights fall past exp's clamp at -87 or underflow, the top one
    nears 1; the vectorized softmax still gives the portable bits (lengths past and short of
    whole vectors)."""
    require(path)
    q, cache, tables, seq, positions = paged_case(
        1, heads=9, kv_heads=3, head_dim=64, block_size=16, positions=POSITIONS,
        dtype=torch.bfloat16)
    case = (q * scale, cache, tables, seq, positions)
    fast = kernel.paged_attention(*case, 64**-0.5, path=path)
    assert torch.isfinite(fast).all()
    assert torch.equal(fast, kernel.paged_attention(*case, 64**-0.5, path="portable"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_prefill_chunks_compute_each_rows_bits_alone(dtype, heads, kv_heads, head_dim,
                                                      block_size):
    """A prefill chunk's tokens share each key they read (runs of consecutive positions), and
    each token's output is still the bits it has alone, on every path, and attention."""
    case = prefill_case(2, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype)
    q, cache, tables, seq, positions = case
    portable = kernel.paged_attention(*case, head_dim**-0.5, path="portable")
    torch.testing.assert_close(portable.double(), dense_reference(*case), rtol=0, atol=2e-5)
    for path in kernel.available_paths():
        together = kernel.paged_attention(*case, head_dim**-0.5, path=path)
        assert torch.equal(together, portable), path
        for r in range(q.shape[0]):
            alone = kernel.paged_attention(q[r : r + 1], cache, tables, seq[r : r + 1],
                                           positions[r : r + 1], head_dim**-0.5, path=path)
            assert torch.equal(alone[0], together[r]), (path, r)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_runs_cut_by_kv_head_across_threads_keep_their_bits(threads, heads, kv_heads, head_dim,
                                                            block_size):
    """Fewer runs than threads (a decode alone, two beside three threads, a short prompt
    alone): the threads share each run's KV heads, and every row keeps the bits it has on one
    thread, on every path."""
    q, cache, tables, seq, positions = prefill_case(3, heads=heads, kv_heads=kv_heads,
                                                    head_dim=head_dim, block_size=block_size,
                                                    dtype=torch.bfloat16)
    cuts = [(r, r + 1) for r in range(0, q.shape[0], 7)] + [(40, 42), (69, 72)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = kernel.paged_attention(q, cache, tables, seq, positions, head_dim**-0.5,
                                          path="portable")
        torch.set_num_threads(threads)
        for path in kernel.available_paths():
            for a, b in cuts:
                rows = kernel.paged_attention(q[a:b], cache, tables, seq[a:b], positions[a:b],
                                              head_dim**-0.5, path=path)
                assert torch.equal(rows, expected[a:b]), (path, a, b)
    finally:
        torch.set_num_threads(before)


def test_the_widest_path_runs_by_default_and_the_env_var_forces_one(monkeypatch):
    paths = kernel.available_paths()
    assert paths[-1] == "portable" and paths == [p for p in PATHS if p in paths]
    case = paged_case(0, heads=9, kv_heads=3, head_dim=64, block_size=16, positions=POSITIONS,
                      dtype=torch.bfloat16)
    calls = []
    real = kernel._module

    class Spy:
        def __getattr__(self, name):
            def call(*args):
                calls.append(args[-1])
                return getattr(real(), name)(*args)
            return call

    monkeypatch.setattr(kernel, "_module", Spy)
    kernel.paged_attention(*case, 0.125)
    monkeypatch.setenv(kernel.PATH_ENV, "portable")
    kernel.paged_attention(*case, 0.125)
    kernel.silu_mul(torch.randn(2, 8))
    assert calls == ["auto", "portable", "portable"]
    monkeypatch.setattr(kernel, "_module", real)
    with pytest.raises(RuntimeError, match="unknown kernel path"):
        kernel.silu_mul(torch.randn(2, 8), path="sse2")
    missing = [p for p in PATHS if p not in paths]
    for path in missing:  # never a silent fallback to another path
        with pytest.raises(RuntimeError, match="not available"):
            kernel.silu_mul(torch.randn(2, 8), path=path)


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


def bf16_close(actual, expected):
    """Equal up to the bf16 rounding of results computed in float32 in another order."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=8e-3, atol=1e-5)


def rope_table(positions=64, half_dim=8):
    angles = torch.arange(positions).float()[:, None] * (1.0 / 100 ** (torch.arange(half_dim) / half_dim))
    return torch.polar(torch.ones_like(angles), angles).unsqueeze(1)


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(delta_dtype, out_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g) * 3
    weight = torch.rand(200, generator=g) + 0.5
    delta = None if delta_dtype is None else torch.randn(37, 200, generator=g).to(delta_dtype)
    x_torch, x_kernel = x.clone(), x.clone()
    expected = TorchLayerOps.add_rms_norm(x_torch, delta, weight, 1e-5, out_dtype)
    actual = KernelLayerOps.add_rms_norm(x_kernel, delta, weight, 1e-5, out_dtype)
    assert torch.equal(x_kernel, x_torch)  # the residual add is one float32 addition either way
    assert actual.dtype == out_dtype
    if out_dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    else:
        bf16_close(actual, expected)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_matches_torch(qkv_dtype, cache_dtype):
    heads, kv_heads, dim, tokens = 6, 2, 16, 11
    rope = rope_table(half_dim=dim // 2)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(qkv_dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(5 * 4, generator=g)[:tokens]
    caches = [torch.zeros(5, 4, 2, kv_heads, dim, dtype=cache_dtype) for _ in range(2)]
    q_torch = TorchLayerOps(rope, torch.float32).rope_write(  # rotates float32 qkv in place
        qkv.clone(), positions, slots, caches[0], heads)
    q_kernel = KernelLayerOps(rope).rope_write(qkv, positions, slots, caches[1], heads)
    assert q_kernel.dtype == torch.float32
    torch.testing.assert_close(q_kernel, q_torch, rtol=1e-6, atol=1e-6)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(caches[1], caches[0], rtol=1e-6, atol=1e-6)
    else:
        bf16_close(caches[1], caches[0])
    assert caches[1].flatten(2).abs().sum(-1).count_nonzero() == tokens  # only their slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(9, 2 * 100, generator=g) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # no overflow at the extremes
    expected = TorchLayerOps.silu_mul(gate_up.float())
    actual = KernelLayerOps.silu_mul(gate_up)
    assert actual.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-7)
    else:
        bf16_close(actual, expected)


def same_bits(a, b):
    """Bit-identical, where a NaN matches any NaN (which NaN an operation on NaNs returns is
    the hardware's choice, not part of the arithmetic; torch.equal calls NaN unequal to
    itself)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    nan = a.isnan()
    return (a.dtype == b.dtype and torch.equal(nan, b.isnan())
            and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan]))


def layer_ops_case(seed, rows, width, dtype):
    """Inputs for every fused op, with widths that leave tails after whole registers and NaN,
    infinities, signed zeros and extremes among ordinary values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 4
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 100.0, -100.0,
                            1e-30, -87.5, 3.4e38])
    x.view(-1)[: special.numel()] = special
    return x.to(dtype)


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("width", [64, 200, 7, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorized_layer_ops_compute_the_portable_bits(path, width, dtype):
    require(path)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g) * 3
    weight = torch.rand(width, generator=g) + 0.5
    delta = layer_ops_case(1, 9, width, dtype)
    for out_dtype in (torch.float32, torch.bfloat16):
        results = []
        for p in (path, "portable"):
            xp = x.clone()
            results.append((kernel.add_rms_norm(xp, delta, weight, 1e-5, out_dtype, path=p), xp))
        assert same_bits(results[0][1], results[1][1])  # the residual stream
        assert same_bits(results[0][0], results[1][0])
    gate_up = layer_ops_case(2, 9, 2 * width, dtype)
    fast, portable = (kernel.silu_mul(gate_up, path=p) for p in (path, "portable"))
    assert same_bits(fast, portable)


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("dim", [16, 64, 128, 6])
@pytest.mark.parametrize(("qkv_dtype", "cache_dtype"),
                         [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                          (torch.bfloat16, torch.bfloat16)])
def test_vectorized_rope_write_computes_the_portable_bits(path, dim, qkv_dtype, cache_dtype):
    require(path)
    heads, kv_heads, tokens = 6, 2, 13
    cos_sin = torch.view_as_real(rope_table(positions=64, half_dim=dim // 2)).contiguous()
    g = torch.Generator().manual_seed(dim)
    qkv = layer_ops_case(dim, tokens, (heads + 2 * kv_heads) * dim, qkv_dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(5 * 4, generator=g)[:tokens]
    outs = []
    for p in (path, "portable"):
        cache = torch.zeros(5, 4, 2, kv_heads, dim, dtype=cache_dtype)
        outs.append((kernel.rope_write(qkv, cos_sin, positions, slots, cache, heads, path=p),
                     cache))
    (q_fast, cache_fast), (q_portable, cache_portable) = outs
    assert same_bits(q_fast, q_portable)
    assert same_bits(cache_fast, cache_portable)


def test_layer_ops_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 64, generator=g)
    weight = torch.rand(64, generator=g)
    full = KernelLayerOps.add_rms_norm(x.clone(), x.to(torch.bfloat16), weight, 1e-6, torch.float32)
    gate_up = torch.randn(70, 128, generator=g).to(torch.bfloat16)
    act = KernelLayerOps.silu_mul(gate_up)
    for rows in (1, 2, 17, 69):
        assert torch.equal(KernelLayerOps.add_rms_norm(
            x[:rows].clone(), x[:rows].to(torch.bfloat16), weight, 1e-6, torch.float32),
            full[:rows])
        assert torch.equal(KernelLayerOps.silu_mul(gate_up[:rows]), act[:rows])


def test_layer_ops_refuse_bad_input():
    rope = rope_table(positions=8, half_dim=8)
    cache = torch.zeros(2, 4, 2, 1, 16)
    qkv = torch.randn(1, 4 * 16)
    ops = KernelLayerOps(rope)
    with pytest.raises(RuntimeError, match="out of range"):  # never a write outside the cache
        ops.rope_write(qkv, torch.tensor([0]), torch.tensor([8]), cache, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_write(qkv, torch.tensor([8]), torch.tensor([0]), cache, 2)
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_write(qkv, torch.tensor([0]), torch.tensor([0]), cache, 3)
    with pytest.raises(RuntimeError, match="delta must have"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6, torch.float32)
    with pytest.raises(RuntimeError, match="even width"):
        ops.silu_mul(torch.randn(2, 7))


# each bf16 path and the instructions it needs
BF16_PATHS = [pytest.param(path, marks=pytest.mark.skipif(
    path not in kernel.bf16_linear_paths(),
    reason=f"no {path} bf16 matmul in this build or CPU (it needs {needs})"))
    for path, needs in (("amx", "AMX-BF16"), ("avx512", "AVX512-BF16"))]


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 40, 24), (7, 37, 11), (64, 300, 576), (33, 70, 1536)])
def test_bf16_linear_is_a_bf16_matmul_with_float32_results(path, rows, out_features,
                                                           in_features):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    y = kernel.Bf16Linear(weight)(x, path=path)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    # bf16 products are exact in float32: only the order of the float32 sum differs
    expected = x.bfloat16().double() @ weight.bfloat16().double().T
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * in_features**0.5)


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("in_features", [64, 608])  # AMX: 2 k tiles, and 19
@pytest.mark.parametrize("out_features", [100, 84])  # panel pairs: 4 (the last part padding), 3
def test_bf16_linear_rows_do_not_depend_on_the_batch(path, in_features, out_features):
    g = torch.Generator().manual_seed(5)
    head = kernel.Bf16Linear(torch.randn(out_features, in_features, generator=g))
    # magnitudes 2^-6..2^6 apart: sums that round at most steps, so any change of order shows
    scales = torch.exp2(torch.randint(-6, 7, (257, in_features), generator=g).float())
    x = torch.randn(257, in_features, generator=g) * scales
    full = head(x, path=path)
    for rows in (1, 2, 5, 6, 7, 13, 16, 17, 31, 32, 33, 69, 256):
        assert torch.equal(head(x[:rows], path=path), full[:rows])
        assert torch.equal(head(x[rows - 1:rows], path=path), full[rows - 1:rows])


@pytest.mark.parametrize("path", BF16_PATHS)
def test_bf16_linear_rounds_float32_inputs_as_torch_does(path):
    """The kernel converts float32 rows to bf16 itself: the same bits as torch's conversion
    first, ties to even included, for rows of a wider tensor too."""
    g = torch.Generator().manual_seed(6)
    head = kernel.Bf16Linear(torch.randn(48, 37, generator=g))
    wide = torch.randn(100, 50, generator=g)
    halfway = ((wide.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)
    wide[::3] = halfway[::3]  # exactly between two bf16 values
    x = wide[:, :37]  # rows 50 floats apart; 37: two vectors and a tail a row
    assert torch.equal(head(x, path=path), head(x.bfloat16(), path=path))
    assert torch.equal(head(x, path=path), head(x.contiguous(), path=path))


@pytest.mark.skipif(not kernel.bf16_linear_paths(), reason="no kernel build with AVX512-BF16 here")
def test_bf16_linear_runs_the_fastest_path_by_default_and_names_the_others():
    head = kernel.Bf16Linear(torch.randn(40, 64))
    x = torch.randn(20, 64)
    assert torch.equal(head(x), head(x, path=kernel.bf16_linear_paths()[0]))
    with pytest.raises(RuntimeError, match="unknown bf16_linear path"):
        head(x, path="avx2")
    if "amx" not in kernel.bf16_linear_paths():
        with pytest.raises(RuntimeError, match="no AMX path"):
            head(x, path="amx")


def gguf_blocks(qtype, out_features, in_features, seed):
    """A random weight quantized to GGUF blocks, and its dequantization (gguf's own code)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    g = torch.Generator().manual_seed(seed)
    kind = GGMLQuantizationType[qtype]
    blocks = quantize(torch.randn(out_features, in_features, generator=g).numpy(), kind)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, kind))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 40, 64), (3, 37, 96), (4, 16, 32), (9, 300, 576), (64, 70, 1536)])
def test_quant_linear_is_a_float32_matmul_on_the_dequantized_weights(qtype, rows, out_features,
                                                                     in_features):
    blocks, weight = gguf_blocks(qtype, out_features, in_features, rows)
    linear = kernel.QuantLinear(blocks, qtype, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7))
    expected = x.double() @ weight.double().T
    for path in kernel.available_paths():
        y = linear(x, path=path)
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        # float32 rounding of the sum only: activations are not rounded to 8 bits (that alone
        # would be errors of ~1e-2 here)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-6 * in_features**0.5)


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("in_features", [576, 1536])
def test_vectorized_quant_linear_computes_the_portable_bits(path, qtype, in_features):
    require(path)
    blocks, _ = gguf_blocks(qtype, 53, in_features, 3)
    linear = kernel.QuantLinear(blocks, qtype, in_features)
    x = torch.randn(39, in_features, generator=torch.Generator().manual_seed(8)) * 3
    # block tiles below 5 rows (AVX2) or 8 (AVX-512), dequantized panels from there in tiles of
    # up to 6 rows (13: 5 + 4 + 4; 53 columns: a partial panel)
    for rows in (1, 2, 3, 4, 5, 7, 8, 11, 13, 16, 17, 39):
        assert same_bits(linear(x[:rows], path=path), linear(x[:rows], path="portable"))


def test_quant_linear_rows_do_not_depend_on_the_batch():
    """Each output is one fixed chain whatever the row count: 1 to 257 rows, every path."""
    blocks, _ = gguf_blocks("Q4_1", 45, 192, 4)
    linear = kernel.QuantLinear(blocks, "Q4_1", 192)
    x = torch.randn(257, 192, generator=torch.Generator().manual_seed(9))
    full = linear(x)
    for rows in range(1, 258):
        assert torch.equal(linear(x[:rows]), full[:rows]), rows
    for path in kernel.available_paths():  # and the same bits on every path
        assert torch.equal(linear(x, path=path), full)


def test_quant_linear_reads_the_bundled_gguf_blocks():
    """The bundled model's own Q4_1 and Q8_0 tensors, as the loader hands them over."""
    from engine.loader import read_gguf
    from engine.model_files import BundledModelMissing, bundled_model_path

    try:
        gguf = read_gguf(bundled_model_path())
    except BundledModelMissing as exc:
        pytest.skip(str(exc))
    infos = {t.name: t for t in gguf.tensors}
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        info = infos[name]
        blocks = torch.from_numpy(gguf.raw(info).copy())[:300]
        weight = gguf.dequantize(info)[:300]
        x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(10))
        y = kernel.QuantLinear(blocks, info.qtype.name, weight.shape[1])(x)
        torch.testing.assert_close(y.double(), x.double() @ weight.double().T, rtol=0,
                                   atol=2e-6 * weight.shape[1] ** 0.5)


def test_quant_linear_refuses_bad_input():
    blocks, _ = gguf_blocks("Q4_1", 4, 64, 5)
    with pytest.raises(ValueError, match="do not hold"):
        kernel.QuantLinear(blocks, "Q4_1", 96)
    with pytest.raises(RuntimeError, match="does not match the blocks"):
        kernel.QuantLinear(blocks, "Q4_1", 64)(torch.randn(2, 96))


@pytest.mark.skipif("avx512" not in kernel.bf16_linear_paths(),
                    reason="no AVX512-BF16 bf16 matmul in this build or CPU (the blocks' bf16 "
                           "products compute its bits)")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(40, 64), (37, 96), (300, 576), (70, 1536)])
def test_block_bf16_linear_computes_the_bf16_kernels_bits(qtype, out_features, in_features):
    """Reading the blocks, the bits of the bf16 kernel's AVX512-BF16 path on their dequantized
    weight at every row count, so batch-invariant mode may run either for any step. Partial
    panels (37, 40, 70 columns), one row's four panels a pass (300), two rows' two, more rows'
    blocks of up to 16 (257: 16 blocks and a row)."""
    blocks, weight = gguf_blocks(qtype, out_features, in_features, 6)
    reading_blocks = kernel.BlockBf16Linear(kernel.QuantLinear(blocks, qtype, in_features))
    dense = kernel.Bf16Linear(weight)
    g = torch.Generator().manual_seed(11)
    # magnitudes 2^-6..2^6 apart: sums that round at most steps, so any change of order shows
    scales = torch.exp2(torch.randint(-6, 7, (257, in_features), generator=g).float())
    x = torch.randn(257, in_features, generator=g) * scales
    full = dense(x, path="avx512")
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 257):
        assert torch.equal(reading_blocks(x[:rows]), full[:rows]), rows
    assert torch.equal(reading_blocks(x[:9].bfloat16()), dense(x[:9].bfloat16(), path="avx512"))
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        reading_blocks(torch.randn(2, in_features + 32))


def test_a_kernel_lets_other_python_threads_run():
    """The kernels release the GIL, as torch's operators do: the API's threads (retrieval,
    receipts, the event loop) run while the engine thread is inside one."""
    blocks, _ = gguf_blocks("Q8_0", 1536, 1536, 5)
    linear = kernel.QuantLinear(blocks, "Q8_0", 1536)
    x = torch.randn(256, 1536, generator=torch.Generator().manual_seed(10))
    linear(x, path="portable")  # built and warm
    inside = threading.Event()
    done = threading.Event()
    progress = []

    def run_kernel():
        inside.set()
        for _ in range(5):
            linear(x, path="portable")  # 80 ms or more each
        done.set()

    worker = threading.Thread(target=run_kernel)
    worker.start()
    inside.wait()
    while not done.is_set():
        progress.append(time.perf_counter())  # Python bytecode: needs the GIL
    worker.join()
    gaps = [b - a for a, b in itertools.pairwise(progress)]
    # Holding the GIL, each kernel call would stop this loop for its whole duration.
    assert len(progress) > 1000 and max(gaps) < 0.04, (len(progress), max(gaps))
