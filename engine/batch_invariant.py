"""Batch-invariant mode: a request's logits do not depend on what else shares its steps.

Under continuous batching a request's companions, its place in the batch and its prefill chunk
boundaries change from run to run. Kernels whose reduction order follows the batch shape then
change the bits of its logits, and a near-tie in greedy decoding flips a token. In this mode
every op that reduces over something gets an order fixed by the token alone:

* attention: the fixed-order kernel for every row (engine/csrc/fixed_order_attention.cpp),
  prefill and decode alike, reading the paged cache in place;
* linear layers: the bf16 matmul kernel (engine/csrc/bf16_linear.cpp, CPUs with AVX512-BF16
  or AMX; a GGUF's too, in place of its blocks) computes each output as one fixed chain,
  row-invariant by construction; so do a GGUF's blocks (engine/csrc/quant_linear.cpp), which
  take every row of a float32 model's matmuls elsewhere. Where oneDNN runs them instead, it
  uses a matrix-vector kernel for one row and a matrix-matrix kernel for more, with different
  reduction orders; from two rows up its kernels are row-invariant for the
  shapes we probe. So a linear never sees fewer than two rows (a lone row gets a zero companion),
  and :func:`make_linears_invariant` proves the property for each weight shape at start-up over
  row counts from 2 to 257 -- where it fails (another backend, another CPU), that shape falls
  back to fixed tiles of ``ROW_TILE`` rows, invariant by construction;
* RMSNorm and the other element-wise work between matmuls run in the fused C++ layer ops
  (engine/csrc/layer_ops.cpp): one row at a time, sums in a fixed order (the mode requires
  the C++ kernels);
* sampling is per row already (engine/sampler.py), and matmul precision never depends on the
  step (bf16 at every step on CPUs with native bf16, see engine.model.default_matmul_dtype).

The price is measured by bench/batch_invariance.py: under 5 % on the CPU kinds measured, so
EngineConfig turns the mode on wherever it runs (``batch_invariant="auto"``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PROBE_ROWS = (2, 3, 7, 16, 33, 64, 65, 192, 257)
ROW_TILE = 64  # rows per matmul call in the tile fallback


class BatchInvarianceUnsupported(RuntimeError):
    """This build cannot give batch-invariant results."""


def _probe(fn, width: int, dtype: torch.dtype) -> bool:
    """Whether ``fn``'s rows come out bit-identical for every probed row count."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS), width, generator=g).to(dtype)
    full = fn(x)
    return all(torch.equal(fn(x[:m]), full[:m]) for m in PROBE_ROWS)


def make_linears_invariant(linears: Iterable) -> dict[tuple, str]:
    """Put every linear on a row-invariant path; returns the path chosen per weight shape and
    dtype, ``"rows"`` (at least two rows, probed) or ``"tiles"`` (fixed tiles)."""
    chosen: dict[tuple, str] = {}
    for linear in linears:
        shape = (linear.out_features, linear.in_features, str(linear.dtype).removeprefix("torch."))
        if shape not in chosen:  # probe the "rows" path on the first linear of this shape
            linear.min_rows, linear.row_tile = 2, None
            chosen[shape] = "rows" if _probe(linear, linear.in_features, linear.dtype) else "tiles"
        linear.min_rows, linear.row_tile = (2, None) if chosen[shape] == "rows" else (0, ROW_TILE)
    return chosen
