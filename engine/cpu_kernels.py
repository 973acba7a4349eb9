"""Build and call the engine's C++ CPU kernels (engine/csrc/).

* :func:`paged_attention`, the fixed-order paged attention (fixed_order_attention.cpp);
* :func:`add_rms_norm`, :func:`rope_write` and :func:`silu_mul`, the fused element-wise work
  between a decoder layer's matmuls (layer_ops.cpp);
* :class:`Bf16Linear`, a bf16 matmul with a float32 result (bf16_linear.cpp; AMX or
  AVX512-BF16);
* :class:`QuantLinear`, a float32 matmul reading its weight as GGUF blocks (quant_linear.cpp);
* :class:`BlockStack`, a decoder's layers on the kernels above in one call (block_stack.cpp).

Implementations: each kernel above (but the bf16 matmul, AMX or AVX512-BF16 only: see
:class:`Bf16Linear`) has a portable path and, where this CPU has the instructions, AVX2 and
AVX-512 paths computing the same bits (engine/csrc/simd.h). The widest available runs unless
``INHERENT_CPU_PATH`` (``avx512``, ``avx2``, ``portable``) or a call's ``path`` argument names
one; naming one this CPU lacks is an error.

Compiled on first use with the system C++ compiler through torch's extension loader and cached
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``): under a minute once per
machine and source version (only bindings.cpp includes the C++ frontend), a fraction of a second
after. It is built for the CPU it runs on (``-march=native``), so the build's name carries a
digest of the CPU's flags (a home directory shared by different machines never loads a build
with instructions its CPU lacks) and of the sources and their folder (two checkouts never
rebuild over each other).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("fixed_order_attention.cpp", "layer_ops.cpp", "bf16_linear.cpp",
                        "quant_linear.cpp", "block_stack.cpp", "bindings.cpp")]
PATH_ENV = "INHERENT_CPU_PATH"  # forces an implementation: avx512, avx2 or portable


class KernelUnavailable(RuntimeError):
    """The kernels could not be built here (no compiler, or not a CPU build)."""


def _build_digest() -> str:
    """The CPU's flags, the sources' folder and their bytes: two checkouts on one machine build
    side by side instead of over each other (torch's build files name the sources by path, so
    two checkouts of the same sources rebuilt each other's build on every first use), and never
    load each other's build."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.blake2b(flags.encode(), digest_size=6)
    digest.update(str(Path(__file__).resolve().parent).encode())
    for source in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=f"inherent_cpu_kernels_{_build_digest()}",
            sources=[str(s) for s in SOURCES],
            # -fopenmp: at::parallel_for is OpenMP in torch's CPU builds; without the flag its
            # pragma is dropped and the kernels run on one thread. -ffp-contract=off: the
            # compiler fuses no multiply-add we did not write (fixed-order arithmetic).
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
                          "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # compiler missing or failing: OSError, CalledProcessError, ...
        raise KernelUnavailable(f"could not build the CPU kernels (engine/csrc): {exc}") from exc


def ensure_built() -> None:
    """Build (or load) the kernels now, so a failure shows at engine start, not mid-request."""
    _module()


@functools.cache
def available() -> bool:
    """Whether the kernels build here (once per process; a failure is remembered)."""
    try:
        ensure_built()
    except KernelUnavailable:
        return False
    return True


def available_paths() -> list[str]:
    """The implementations this build and CPU run, widest first (``portable`` always)."""
    return _module().available_paths()


def _path(path: str | None) -> str:
    return path or os.environ.get(PATH_ENV) or "auto"


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """Each row of ``q`` [T, heads * head_dim] attends its sequence's keys 0..position.

    ``cache`` [blocks, block_size, 2, kv_heads, head_dim] float32 or bfloat16 (q and the result
    are float32); ``block_tables`` [B, max] int32; ``token_seq`` [T] int32 (row -> sequence);
    ``positions`` [T] int64. ``path`` forces an implementation (all compute the same bits; the
    vectorized ones cover head sizes 64 and 128, others run the portable code).
    """
    return _module().paged_attention(q, cache, block_tables, token_seq, positions, scale,
                                     _path(path))


def set_decode_blocks_in_turn(on: bool) -> bool:
    """Whether a lone decode's attention reads two cache blocks' keys in turn (on by default on
    Intel CPUs, where it measured faster; off elsewhere) or one block at a time: the same bits
    either way. Returns the setting it replaced."""
    return _module().set_decode_blocks_in_turn(on)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype, *, path: str | None = None,
) -> torch.Tensor:
    """``x += delta`` in place (float32 residual stream; delta float32 or bfloat16, or None),
    then RMSNorm of ``x`` times ``weight``, returned in ``out_dtype`` (float32 or bfloat16)."""
    return _module().add_rms_norm(x, delta, weight, eps, out_dtype == torch.bfloat16,
                                  _path(path))


def rope_write(
    qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    cache: torch.Tensor, num_heads: int, *, path: str | None = None,
) -> torch.Tensor:
    """RoPE on the q and k heads of ``qkv`` [T, (heads + 2 kv_heads) * D] (pairs side by side),
    k and v written into the cache at ``slots``; returns q [T, heads * D] float32.
    ``cos_sin`` [positions, D / 2, 2] float32."""
    return _module().rope_write(qkv, cos_sin, positions, slots, cache, num_heads, _path(path))


def silu_mul(gate_up: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2 I] (gate, then up), in its dtype."""
    return _module().silu_mul(gate_up, _path(path))


def bf16_linear_supported() -> bool:
    """Whether this CPU's build has :class:`Bf16Linear` (AVX512-BF16 or AMX)."""
    return available() and _module().bf16_linear_supported


def bf16_linear_paths() -> list[str]:
    """:class:`Bf16Linear`'s implementations here, the one it runs by default first: ``amx``
    (tile dot products), ``avx512`` (AVX512-BF16 dot products)."""
    return _module().bf16_linear_paths() if available() else []


class Bf16Linear:
    """``y = x @ weight.T``: x (float32 or bf16) and the weight rounded to bf16, float32
    accumulation and result. Each output element is one fixed chain over k: row-invariant by
    construction. AMX where the CPU has it, else AVX512-BF16: the two add a pair's products in
    opposite orders, so their bits differ; ``path`` (``amx``, ``avx512``) picks one."""

    __slots__ = ("in_features", "out_features", "packed")

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = _module().pack_bf16_weight(weight)

    def __call__(self, x: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
        return _module().bf16_linear(x, self.packed, self.out_features, path or "auto")


# ggml's numbers of the GGUF block types QuantLinear reads
QUANT_TYPES = {"Q4_1": 3, "Q8_0": 8}


class QuantLinear:
    """``y = x @ W.T`` with W as GGUF blocks (``blocks`` [out, in / 32 * block bytes] uint8, the
    tensor's rows as stored), dequantized in registers: float32 activations, accumulation and
    result -- a float32 matmul on the dequantized weights, in one fixed order per output
    (row-invariant by construction)."""

    __slots__ = ("blocks", "in_features", "out_features", "qtype")

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int):
        self.qtype = QUANT_TYPES[qtype]
        self.blocks = blocks.contiguous()
        self.out_features, self.in_features = blocks.shape[0], in_features
        if blocks.shape[1] != in_features // 32 * _module().quant_block_bytes(self.qtype):
            raise ValueError(f"{qtype} blocks of {blocks.shape[1]} bytes a row do not hold "
                             f"{in_features} weights")

    def __call__(self, x: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
        return _module().quant_linear(x.float(), self.blocks, self.qtype, _path(path))


class BlockBf16Linear:
    """:class:`Bf16Linear`'s AVX512-BF16 result on a :class:`QuantLinear`'s dequantized weight,
    bit for bit, reading the GGUF blocks (0.6-1 byte a weight against bf16's 2) and rounding
    each weight to bf16 in registers (bf16_linear.cpp): either kernel may take any row."""

    __slots__ = ("in_features", "out_features", "packed", "qtype")

    def __init__(self, blocks: QuantLinear):
        self.in_features, self.out_features = blocks.in_features, blocks.out_features
        self.qtype = blocks.qtype
        self.packed = _module().pack_block_bf16(blocks.blocks, blocks.qtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _module().block_bf16_linear(x, self.packed, self.qtype, self.out_features)


class BlockStack:
    """A decoder's layers in one call (block_stack.cpp), each layer's calls as the model makes
    them one by one -- add_rms_norm, linear qkv, rope_write, paged_attention, linear o,
    add_rms_norm, linear gate_up, silu_mul, linear down, each linear a QuantLinear, a Bf16Linear
    or a BlockBf16Linear -- so the same bits, without Python between them. For steps whose every
    matmul runs on these kernels and every attention row on the fixed-order kernel."""

    __slots__ = ("_stack",)

    def __init__(self, norms: list[torch.Tensor],
                 linears: list[QuantLinear | Bf16Linear | BlockBf16Linear],
                 cos_sin: torch.Tensor, num_heads: int, eps: float, scale: float,
                 norm_dtype: torch.dtype):
        """Per layer: ``norms`` [input, post-attention], ``linears`` [qkv, o, gate_up, down];
        ``norm_dtype``: what the norms return (the matmuls' dtype; the blocks read float32)."""
        module = _module()
        matrices = [(lin.blocks, lin.qtype) if isinstance(lin, QuantLinear)
                    else (lin.packed, module.block_bf16 + lin.qtype)
                    if isinstance(lin, BlockBf16Linear)
                    else (lin.packed, module.packed_bf16) for lin in linears]
        self._stack = module.BlockStack(
            norms, [m for m, _ in matrices], [qtype for _, qtype in matrices],
            [lin.out_features for lin in linears], cos_sin, num_heads, eps, scale,
            norm_dtype == torch.bfloat16)

    def __call__(self, x: torch.Tensor, caches: list[torch.Tensor], positions: torch.Tensor,
                 slots: torch.Tensor, block_tables: torch.Tensor, token_seq: torch.Tensor, *,
                 path: str | None = None) -> torch.Tensor:
        """``x`` [T, hidden] float32 (the residual stream, updated in place); returns the last
        layer's output. The other arguments as :func:`rope_write` and :func:`paged_attention`
        take them."""
        return self._stack.forward(x, caches, positions, slots, block_tables, token_seq,
                                   _path(path))
