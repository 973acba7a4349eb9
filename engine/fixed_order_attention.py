"""Build and call the fixed-order paged attention kernel (engine/csrc/fixed_order_attention.cpp).

Compiled on first use with the system C++ compiler through torch's extension loader and cached
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``): about 40 s once per
machine and source version, a fraction of a second after. It is built for the CPU it runs on
(``-march=native``), so the build's name carries a digest of the CPU's flags: a home directory
shared by different machines never loads a build with instructions its CPU lacks.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "fixed_order_attention.cpp"


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here (no compiler, or not a CPU build)."""


def _cpu_digest() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=f"inherent_fixed_order_attention_{_cpu_digest()}",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for is OpenMP in torch's CPU builds; without the flag its
            # pragma is dropped and the kernel runs on one thread.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
                          "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # compiler missing or failing: OSError, CalledProcessError, ...
        raise KernelUnavailable(
            f"could not build the fixed-order attention kernel ({SOURCE.name}): {exc}"
        ) from exc


def ensure_built() -> None:
    """Build (or load) the kernel now, so a failure shows at engine start, not mid-request."""
    _module()


@functools.cache
def available() -> bool:
    """Whether the kernel builds here (once per process; a failure is remembered)."""
    try:
        ensure_built()
    except KernelUnavailable:
        return False
    return True


def vectorized() -> bool:
    """Whether the build has the AVX-512 implementation (head sizes 64 and 128)."""
    return _module().vectorized


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    portable: bool = False,
) -> torch.Tensor:
    """Each row of ``q`` [T, heads * head_dim] attends its sequence's keys 0..position.

    ``cache`` [blocks, block_size, 2, kv_heads, head_dim] float32 or bfloat16 (q and the result
    are float32); ``block_tables`` [B, max] int32; ``token_seq`` [T] int32 (row -> sequence);
    ``positions`` [T] int64. ``portable`` forces the portable implementation, which computes
    the same bits as the vectorized one (tests check that).
    """
    return _module().paged_attention(q, cache, block_tables, token_seq, positions, scale,
                                     portable)
