"""The element-wise work between a decoder layer's matmuls, in two implementations.

* :class:`KernelLayerOps`: fused C++ (engine/csrc/layer_ops.cpp) on CPU with a float32
  residual stream. Each activation is read and written once and converted where it is made; the
  torch version of the same work is about fifteen ops per layer, each a dispatch and a pass over
  memory (measured in bench/model_step.py).
* :class:`TorchLayerOps`: torch ops, for everything else (CUDA, bfloat16 activations, a machine
  without a C++ compiler).

Same interface, same math; the fused ops round once where torch rounds after every op (silu,
then the multiply), so the two differ in the last bits, never more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import cpu_kernels


class TorchLayerOps:
    def __init__(self, rope: torch.Tensor, act_dtype: torch.dtype):
        self.rope = rope  # [positions, 1, head_dim / 2] complex
        self.act_dtype = act_dtype

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """``x += delta`` in place, then RMSNorm(x) * weight in ``out_dtype``."""
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (x.shape[-1],), weight, eps).to(out_dtype)

    def rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cache: torch.Tensor, num_heads: int) -> torch.Tensor:
        """RoPE on q and k (pairs side by side), k and v into the cache at ``slots``; returns
        q [T, heads * D] in the activations' dtype."""
        tokens, kv_heads, dim = qkv.shape[0], cache.shape[-2], cache.shape[-1]
        qkv = qkv.to(self.act_dtype)
        qk = qkv[:, : (num_heads + kv_heads) * dim].view(tokens, -1, dim // 2, 2)
        rope = self.rope[positions]
        if qkv.dtype == torch.float32:
            torch.view_as_complex(qk).mul_(rope)
        else:  # no bf16 complex type: rotate in float32
            qk.copy_(torch.view_as_real(torch.view_as_complex(qk.float()) * rope))
        flat_cache = cache.view(-1, 2 * kv_heads * dim)
        flat_cache.index_copy_(0, slots, qkv[:, num_heads * dim :].to(cache.dtype))
        return qkv[:, : num_heads * dim]

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of ``gate_up`` [T, 2 I] (gate, then up)."""
        inter = gate_up.shape[1] // 2
        act = F.silu(gate_up[:, :inter])
        return act.mul_(gate_up[:, inter:])


class KernelLayerOps:
    """The fused C++ ops; needs float32 activations and a float32 or bf16 KV cache on CPU."""

    def __init__(self, rope: torch.Tensor):
        self.cos_sin = torch.view_as_real(rope).contiguous()  # [positions, 1, head_dim / 2, 2]

    add_rms_norm = staticmethod(cpu_kernels.add_rms_norm)
    silu_mul = staticmethod(cpu_kernels.silu_mul)

    def rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cache: torch.Tensor, num_heads: int) -> torch.Tensor:
        return cpu_kernels.rope_write(qkv, self.cos_sin, positions, slots, cache, num_heads)
