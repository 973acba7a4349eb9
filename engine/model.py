"""A Llama-family decoder in plain torch, shaped for few ops per layer.

RMSNorm, RoPE (theta, linear and llama3 scaling), grouped-query attention over the paged KV
cache, SwiGLU, tied or untied LM head. At load time Q/K/V become one matrix and gate/up another,
so a layer is nine calls whatever the batch holds:

    add_rms_norm, qkv matmul, rope_write (RoPE on q and k, k and v into the paged cache),
    attention (see engine/attention.py), o matmul, add_rms_norm (the residual add inside),
    gate_up matmul, silu_mul, down matmul (its output joins the residual in the next norm).

The element-wise calls are fused C++ on CPU and torch ops elsewhere (engine/layer_ops.py). Where
a step's nine calls are all our kernels (matmuls on GGUF blocks or the bf16 kernel, every row on
the fixed-order attention), one C++ call runs every layer (cpu_kernels.BlockStack, see
_build_block_stacks).
Matmuls: bf16 ones on CPUs with AVX512-BF16 or AMX run our C++ kernel (float32 results,
cpu_kernels.Bf16Linear, on AMX tiles where the CPU has them); the others go through oneDNN with
pre-packed weights on CPU (see _Linear). Given a GGUF's blocks (``quantized``), matmuls of few rows read those instead
(cpu_kernels.QuantLinear: float32 arithmetic on the dequantized weights, a fraction of the bytes;
on AVX512-BF16 also cpu_kernels.BlockBf16Linear, the bf16 kernel's bits read from the blocks;
see _BlockLinear). Large freed blocks are kept in the heap (see keep_freed_memory). All measured, not
guessed: bench/model_step.py and the kernels' comments.

RoPE pairs: Hugging Face rotates dimension i with i + head_dim/2. We reorder each head's Q and K
rows once at load so that the pair sits side by side (i, i + 1) -- llama.cpp's own layout -- and
RoPE becomes a complex multiply. Q.K is unchanged: both sides get the same reordering.

The LM head runs only on ``batch.logits_indices`` rows.

Precision: ``dtype`` is the weights' and activations' type (float32 or bfloat16);
``matmul_dtype`` the decoder matmuls' (default: ``dtype``). A float32 model with bfloat16 matmuls
is what the engine runs on CPUs with native bf16 (AVX512-BF16/AMX, see
:func:`default_matmul_dtype`): the residual stream, norms, RoPE and attention stay in float32,
and the LM head reads bf16 but accumulates and returns float32 logits. The KV cache may have its own dtype (bf16 by default beside bf16 matmuls); attention
reads it in the activations' dtype.

Batch invariance: by default a token's logits can depend on its companions (SDPA's blocking
follows the padded key length; oneDNN, where it runs the matmuls, reduces one row differently
from several). The bf16 matmul kernel and the fused layer ops are row-invariant by construction.
``batch_invariant=True`` removes the rest: see engine/batch_invariant.py.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine import cpu_kernels, huge_pages
from engine.attention import (
    FIXED_ALL,
    FIXED_DECODES,
    FIXED_NONE,
    AttentionPlan,
    build_plan,
    paged_attention,
    select_attend,
)
from engine.attention import allocate_kv_cache as _allocate
from engine.batch_invariant import (
    BatchInvarianceUnsupported,
    make_linears_invariant,
)
from engine.forward_batch import ForwardBatch
from engine.layer_ops import KernelLayerOps, TorchLayerOps

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # None, or Hugging Face style: {"rope_type": "linear" | "llama3", "factor": ..., ...}
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4 or 5 spelling of RoPE)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{flag}=true is not supported")
        if hf.get("sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported")
        rope = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or rope)
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        else:
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = rope_type
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that :meth:`from_hf` (and transformers) reads back."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_matmul_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype for a ``dtype`` model's decoder matmuls: bf16 on CPUs with native bf16.

    Measured on 2 cores, a layer's four packed matmuls x 30 layers. Zen 3 (no bf16 instructions):
    bf16 2.4x slower than fp32 at 8 tokens, 6-8x at 64-512, so float32. Zen 4 (AVX512-BF16):
    bf16 faster at every size, 5.5 vs 22 ms at 1 token, 41 vs 82 ms at 64, 150 vs 288 ms at 256
    (~360 GFLOP/s against ~100), so bf16 from the first token.
    """
    if dtype == torch.float32 and torch.device(device).type == "cpu" and native_bf16():
        return torch.bfloat16
    return dtype


def default_kv_cache_dtype(
    kv_cache_dtype: str | None, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.dtype:
    """The KV cache's dtype: as configured, else the matmuls' (bf16 halves what a decode step
    reads from the cache: 64 decodes' attention 5.7 instead of 8.5 ms per layer, one core)."""
    if kv_cache_dtype:
        return getattr(torch, kv_cache_dtype)
    return default_matmul_dtype(dtype, device)


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim / 2], float32, computed as transformers does."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported (default, linear, llama3)")
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-pair divisors
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows from HF's halves (i, i + D/2) to adjacent pairs (2i, 2i + 1)."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, 2, half, -1).transpose(1, 2).reshape(out_features, -1)


# Batch size oneDNN lays the packed weights out for; any batch size runs on them. Measured on
# 2 Zen 3 cores against packing for 1 token: equal at 1 token, 10-25% faster at 2-128 tokens.
_PACK_BATCH_HINT = 64


def keep_freed_memory() -> None:
    """Stop glibc from handing big freed blocks back to the OS.

    glibc serves allocations above 32 MB with fresh mmaps and unmaps them on free; a step's large
    temporaries (gathered K/V, logits, prefill activations) then page-fault in anew every time,
    which on our VMs runs at ~1 GB/s and doubled the decode step of 64 sequences. Raising the
    thresholds keeps such blocks in the heap for reuse. Process-wide and idempotent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 32)


class _Linear:
    """``y = x @ weight.T`` in the weight's dtype.

    On CPU the weight is pre-packed for oneDNN (which picks its kernels by instruction set, not
    by CPU vendor). Measured on 2 Zen 3 cores, a layer's four matmuls against F.linear (MKL):
    1.4x faster at 1 token, ~2x at 2-32 tokens, 1.5x at 64-256. Where packing is unavailable
    (GPU, builds without oneDNN, bf16 without AVX512), F.linear on the dense weight.
    """

    __slots__ = ("dtype", "in_features", "min_rows", "out_features", "packed", "row_tile", "weight")

    def __init__(self, weight: torch.Tensor):
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        # Batch-invariant mode (engine/batch_invariant.py): pad to at least `min_rows` rows, or
        # run fixed tiles of `row_tile` rows.
        self.min_rows = 0
        self.row_tile: int | None = None
        self.weight: torch.Tensor | None = weight.contiguous()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_BATCH_HINT)
            except RuntimeError:  # e.g. bf16 on a CPU without AVX512
                self.packed = None
            else:
                self.weight = None  # the packed copy is all we need

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        rows = x.shape[0]
        if self.row_tile is not None:
            tiles = -(-rows // self.row_tile)
            padded = F.pad(x, (0, 0, 0, tiles * self.row_tile - rows))
            return torch.cat([self._matmul(t) for t in padded.split(self.row_tile)])[:rows]
        if rows < self.min_rows:
            return self._matmul(F.pad(x, (0, 0, 0, self.min_rows - rows)))[:rows]
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


# Most rows a matmul runs on the GGUF blocks before the dense kernel takes over: reading 0.6-1
# byte a weight wins while the weights' bytes dominate, the blocks' float32 FMAs lose once
# arithmetic does. Against our bf16 kernel on AMX tiles, from 5 rows (the bundled model's 120
# decoder matmuls on 2 Xeon cores, weights from memory: blocks against the kernel 4.7 against
# 8.5 ms at 1 row, 6.3-6.4 against 8.5-8.7 at 4, 10.7-10.8 against 8.7-8.9 at 6);
# on AVX512-BF16 dot products, from 8, where the blocks leave tiles for a dequantized panel (2 Zen 5
# cores, AMD EPYC family 26 model 2, two runs: 9.0-10.5 against 10.9-13.9 ms at 5-7 rows, 14.9-16.8
# against 13.4-14.3 at 8). Against oneDNN's float32 GEMM, from 16-32 rows (2 Zen 3 cores, a
# layer's four matmuls: blocks 1.9 against 2.4 ms at 16 rows, 3.5 against 3.4 at 32;
# bench/model_step.py measures both).
BLOCK_MAX_ROWS = {"bf16 AMX": 4, "bf16 kernel": 7, "oneDNN": 16}
# Most rows a matmul reads the blocks as bf16 products (cpu_kernels.BlockBf16Linear, the bf16
# kernel's bits, on AVX512-BF16) before the bf16 kernel takes over, by how the CPU runs 512-bit
# instructions. The bundled model's decode steps at 256, alternated in one process, medians of
# 16 after a 400 MB sweep each (bench/model_step.py --bf16-blocks): on 2 Zen 5 cores (AMD EPYC
# family 26 model 2, 512 bits at once) 1 row 3.6-4.0 against 6.2-7.0 ms, 4 rows 5.8 against
# 8.2-8.6, 8 rows 7.8-7.9 against 10.6-10.7, 16 rows 14.3 against 16.1, 24 rows 21.4 against
# 20.5, 32 rows 28.5 against 26.7. Zen 4 (family 25) runs each as two 256-bit halves, so the
# dequantizing costs twice as long beside the same memory: on 2 Zen 4 cores (model 17), three
# runs, 1 row 6.2-6.5 against 6.6-8.9, 4 rows 8.3-9.3 against 9.7-10.6, 8 rows 13.0-14.3
# against 14.2-14.7, 12 rows 19.7-20.0 against 17.4-19.1, 16 rows 23.0-25.9 against 22.4-23.5.
BLOCK_BF16_MAX_ROWS = {"512-bit units": 16, "Zen 4": 8}


def cpu_is_zen4(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text names an AMD family 25 (Zen 3 and Zen 4; of those only Zen 4
    has the AVX512-BF16 that the blocks as bf16 products need)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    return fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"


@functools.cache
def block_bf16_max_rows() -> int:
    """BLOCK_BF16_MAX_ROWS for this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            zen4 = cpu_is_zen4(f.read())
    except OSError:
        zen4 = False
    return BLOCK_BF16_MAX_ROWS["Zen 4" if zen4 else "512-bit units"]


class _BlockLinear:
    """A matmul on a weight's GGUF blocks for up to ``max_rows`` rows, ``dense`` above: the bf16
    kernel, oneDNN, or the blocks again as bf16 products (a _BlockLinear of its own); ``dense``
    None: the blocks for every row count (batch-invariant mode: one arithmetic whatever the
    batch, as where ``blocks`` computes ``dense``'s bits)."""

    __slots__ = ("blocks", "dense", "in_features", "max_rows", "out_features")

    def __init__(self, blocks: cpu_kernels.QuantLinear | cpu_kernels.BlockBf16Linear,
                 dense: Any, max_rows: int):
        self.blocks, self.dense, self.max_rows = blocks, dense, max_rows
        self.out_features, self.in_features = blocks.out_features, blocks.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is None or x.shape[0] <= self.max_rows:
            return self.blocks(x)
        return self.dense(x)


def _block_linear(parts: Sequence[Any]) -> cpu_kernels.QuantLinear | None:
    """One QuantLinear over the rows of ``parts`` (loader.GGUFBlocks, concatenated as the fused
    matrices are), or None when one is missing or their types differ."""
    if any(p is None for p in parts) or len({(p.qtype, p.in_features) for p in parts}) != 1:
        return None
    blocks = torch.cat([p.blocks for p in parts]) if len(parts) > 1 else parts[0].blocks
    return cpu_kernels.QuantLinear(blocks, parts[0].qtype, parts[0].in_features)


def _streamed_bytes(kernel: Any) -> int:
    """Bytes a matmul kernel reads for a row: its GGUF blocks, or its packed weight."""
    weight = kernel.blocks if isinstance(kernel, cpu_kernels.QuantLinear) else kernel.packed
    return weight.numel() * weight.element_size()


def _kernels_of(linear: Any) -> list[Any]:
    """A model's matmul as the kernels it may run, fewest rows first (a _BlockLinear's tiers)."""
    kernels = []
    while isinstance(linear, _BlockLinear):
        kernels.append(linear.blocks)
        linear = linear.dense
    return kernels if linear is None else [*kernels, linear]


def _weights_onto_huge_pages(linears: Sequence[Any]) -> None:
    """Move the weights our kernels stream every step (bf16 panels, GGUF blocks) into one
    buffer on 2 MB pages (engine/huge_pages.py); oneDNN keeps its packed weights where it put
    them."""
    kernels = [k for lin in linears for k in _kernels_of(lin)]
    owners = [(k, "blocks" if isinstance(k, cpu_kernels.QuantLinear) else "packed")
              for k in kernels if isinstance(k, cpu_kernels.Bf16Linear | cpu_kernels.QuantLinear
                                            | cpu_kernels.BlockBf16Linear)]
    moved = huge_pages.copies([getattr(k, name) for k, name in owners])
    for (kernel, name), tensor in zip(owners, moved, strict=True):
        setattr(kernel, name, tensor)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    # _Linear, cpu_kernels.Bf16Linear or _BlockLinear
    qkv: Any  # [(heads + 2 * kv_heads) * head_dim, hidden], q/k rows RoPE-interleaved
    o: Any  # [hidden, heads * head_dim]
    gate_up: Any  # [2 * intermediate, hidden]
    down: Any  # [hidden, intermediate]


class LlamaModel:
    """Weights plus a forward over a :class:`ForwardBatch` and the paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        matmul_dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
        quantized: Mapping[str, Any] | None = None,
    ):
        """``weights`` uses Hugging Face Llama names (as :mod:`engine.loader` returns them);
        ``quantized``, the same names' GGUF blocks (loader.GGUFBlocks, Checkpoint.quantized),
        read by the matmuls of few rows (every row in batch-invariant mode) on CPU in float32."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        if batch_invariant and (self.device.type != "cpu" or dtype != torch.float32):
            raise BatchInvarianceUnsupported(
                "batch_invariant runs on CPU in float32 only (device "
                f"{self.device.type}, dtype {dtype})")
        self.matmul_dtype = matmul_dtype or dtype
        self.attention_backend, self._attend = select_attend(self.device)
        # The C++ kernels: fixed-order attention takes the decodes (faster than SDPA there)
        # and, in batch-invariant mode, every row; fused layer ops do the element-wise work.
        self._kernels = self.device.type == "cpu" and cpu_kernels.available()
        if batch_invariant and not self._kernels:
            cpu_kernels.ensure_built()  # raises with the compiler's reason
        if self.device.type == "cpu":
            keep_freed_memory()

        def get(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        c = config
        self.embed = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        head = self.embed if tied else get("lm_head.weight")
        # bf16 matmuls on a CPU with AVX512-BF16: the C++ kernel, float32 results (the LM head
        # too: bf16 logits tie). Otherwise oneDNN in the matmul dtype, the LM head in float32.
        bf16_kernel = (self.matmul_dtype == torch.bfloat16 and self._kernels
                       and cpu_kernels.bf16_linear_supported())
        if bf16_kernel:
            self.lm_head = cpu_kernels.Bf16Linear(head)
            head_bytes = head.numel() * 2
        else:
            self.lm_head = _Linear(head)
            head_bytes = head.numel() * head.element_size()
        # GGUF blocks where given, on CPU with the kernels, in a float32 model. Batch-invariant
        # mode runs every row of a matmul in one arithmetic: the bf16 kernel's where the CPU has
        # it (on 2 Xeon cores with AMX a layer's four matmuls at 256 rows: 1.8 against the
        # blocks' 13.6 ms, bench/model_step.py --crossover-only), else the blocks'. Where the
        # bf16 kernel is AVX512-BF16's, the blocks as bf16 products compute its bits from the
        # blocks (BlockBf16Linear; AMX's bits differ): the mode's steps of few rows, and with
        # the mode off the steps between the float32 blocks' limit and theirs.
        bf16_path = cpu_kernels.bf16_linear_paths()[0] if bf16_kernel else None
        as_bf16 = bf16_path == "avx512"
        block_max_rows = BLOCK_MAX_ROWS[
            {"amx": "bf16 AMX", "avx512": "bf16 kernel", None: "oneDNN"}[bf16_path]]
        use_blocks = self._kernels and dtype == torch.float32 and (
            as_bf16 or not (batch_invariant and bf16_kernel))
        quantized = (quantized or {}) if use_blocks else {}
        block_formats: set[str] = set()

        def with_blocks(dense: Any, names: Sequence[str]) -> Any:
            linear = _block_linear([quantized.get(n) for n in names])
            if linear is None:
                return dense
            block_formats.add(quantized[names[0]].qtype)
            if as_bf16:
                dense = _BlockLinear(cpu_kernels.BlockBf16Linear(linear), dense,
                                     block_bf16_max_rows())
                if batch_invariant:
                    return dense
            return _BlockLinear(linear, None if batch_invariant else dense, block_max_rows)

        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = with_blocks(self.lm_head, [head_name])
        if isinstance(self.lm_head, _BlockLinear):
            head_bytes = _streamed_bytes(self.lm_head.blocks)
        self.num_parameters = self.embed.numel() + self.final_norm.numel()
        if not tied:
            self.num_parameters += self.embed.numel()
        # What one batch-1 decode step reads: every weight once, matmuls in their dtype or as
        # blocks (the embedding row gathered is negligible unless it is also the LM head).
        self.decode_weight_bytes = (head_bytes
                                    + self.final_norm.numel() * self.final_norm.element_size())
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            q = _interleave_rope_rows(get(p + "self_attn.q_proj.weight"), c.num_heads)
            k = _interleave_rope_rows(get(p + "self_attn.k_proj.weight"), c.num_kv_heads)
            mats = (
                torch.cat([q, k, get(p + "self_attn.v_proj.weight")]),
                get(p + "self_attn.o_proj.weight"),
                torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                get(p + "mlp.down_proj.weight"),
            )
            norms = (get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight"))
            self.num_parameters += sum(t.numel() for t in (*mats, *norms))
            self.decode_weight_bytes += sum(t.numel() for t in norms) * norms[0].element_size()
            self.decode_weight_bytes += sum(m.numel() for m in mats) * self.matmul_dtype.itemsize
            linears = [cpu_kernels.Bf16Linear(m) if bf16_kernel
                       else _Linear(m.to(self.matmul_dtype)) for m in mats]
            names = ([p + f"self_attn.{w}_proj.weight" for w in "qkv"],
                     [p + "self_attn.o_proj.weight"],
                     [p + f"mlp.{w}_proj.weight" for w in ("gate", "up")],
                     [p + "mlp.down_proj.weight"])
            linears = [with_blocks(lin, n) for lin, n in zip(linears, names, strict=True)]
            for lin, m in zip(linears, mats, strict=True):
                if isinstance(lin, _BlockLinear):  # what a decode reads: the blocks
                    self.decode_weight_bytes += (_streamed_bytes(lin.blocks)
                                                 - m.numel() * self.matmul_dtype.itemsize)
            self.layers.append(_Layer(norms[0], norms[1], *linears))
        # What the matmuls read: named in benchmark output and receipts' diagnostics
        dense_format = str(self.matmul_dtype).removeprefix("torch.")
        if block_formats:
            tiers = [] if batch_invariant else [f"up to {block_max_rows} rows"]
            if as_bf16:
                tiers.append(f"as bf16 up to {block_bf16_max_rows()}"
                             + (" rows" if batch_invariant else ""))
            read = f"gguf {'+'.join(sorted(block_formats))} blocks"
            self.weights_format = (f"{read} {', '.join(tiers)}, {dense_format} above" if tiers
                                   else read)
        else:
            self.weights_format = dense_format

        freq_factors = weights.get("rope_freqs")
        inv_freq = rope_inv_freq(c, freq_factors).to(self.device)
        angles = (
            torch.arange(c.max_position_embeddings, device=self.device).float()[:, None] * inv_freq
        )
        # [positions, 1, head_dim / 2] complex: broadcasts over the heads of q and k
        self.rope = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
        self._torch_ops = TorchLayerOps(self.rope, dtype)
        self._kernel_ops = KernelLayerOps(self.rope) if self._kernels else None
        if self._kernels:
            _weights_onto_huge_pages([self.lm_head, *(lin for layer in self.layers for lin in (
                layer.qkv, layer.o, layer.gate_up, layer.down))])
        # (most rows, stack), ascending: a step runs the first its rows fit. Empty where some
        # call is not our kernel; emptied, every step calls the layers' kernels one by one from
        # Python (the test of the stacks compares the two)
        self.block_stacks = self._build_block_stacks()

        if batch_invariant:
            linears = [self.lm_head]
            for layer in self.layers:
                linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
            # (the bf16 kernel's are row-invariant by construction)
            make_linears_invariant(lin for lin in linears if isinstance(lin, _Linear))

    def _build_block_stacks(self) -> list[tuple[float, cpu_kernels.BlockStack]]:
        """The layers as one kernel call (cpu_kernels.BlockStack) for the steps whose every
        matmul runs on our kernels, each with the most rows a step may have for it: the GGUF
        blocks up to their limit (float32 products, then bf16 ones, where there are both), the
        bf16 kernel for any number above. Measured on the 2-core AVX2 kind (AMD EPYC, family 23
        model 1), a batch-1 decode step of the bundled model, median of 100 steps in four runs:
        24.0-26.9 ms with a Python call per kernel, 21.1-22.1 ms in one call; 8 rows 72-76
        against 68-69 ms."""
        if self._kernel_ops is None or self.dtype != torch.float32:
            return []
        linears = [lin for layer in self.layers
                   for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        stacks: list[tuple[float, list[Any]]] = []
        while all(isinstance(lin, _BlockLinear) for lin in linears):  # tier by tier
            max_rows = min(math.inf if lin.dense is None else lin.max_rows for lin in linears)
            stacks.append((max_rows, [lin.blocks for lin in linears]))
            linears = [lin.dense for lin in linears]
        if all(isinstance(lin, cpu_kernels.Bf16Linear) for lin in linears):
            stacks.append((math.inf, linears))
        norms = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)]
        c = self.config
        return [(rows, cpu_kernels.BlockStack(norms, kernels, self._kernel_ops.cos_sin,
                                              c.num_heads, c.rms_norm_eps, c.head_dim**-0.5,
                                              self.matmul_dtype))
                for rows, kernels in stacks]

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        return allocate_kv_cache(
            self.config, num_blocks, block_size, dtype or self.dtype, self.device
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """Logits ``[len(batch.logits_indices), vocab]`` (float32) for the rows the sampler needs.

        Writes this step's K/V into ``kv_cache`` at ``batch.slot_mapping``.
        """
        c = self.config
        block_size = kv_cache[0].shape[1]
        kernels = (self._kernels and self.dtype == torch.float32
                   and kv_cache[0].dtype in (torch.float32, torch.bfloat16))
        if self.batch_invariant:
            if not kernels:
                raise BatchInvarianceUnsupported("batch_invariant needs a float32 or bf16 KV cache")
            fixed = FIXED_ALL
        else:
            fixed = FIXED_DECODES if kernels else FIXED_NONE
        ops = self._kernel_ops if kernels else self._torch_ops
        attend_fixed = cpu_kernels.paged_attention if kernels else None
        plan = build_plan(batch, block_size, c.num_heads // c.num_kv_heads, fixed, self.dtype)
        eps, matmul_dtype = c.rms_norm_eps, self.matmul_dtype

        # The residual stream x takes each sublayer's output (delta) inside the next norm.
        x = F.embedding(batch.input_ids, self.embed)
        stack = self._block_stack_for(plan) if kernels else None
        if stack is not None:
            delta = stack(x, list(kv_cache), batch.positions, batch.slot_mapping,
                          plan.block_tables, plan.fixed.seq)
        else:
            delta = None
            for layer, cache in zip(self.layers, kv_cache, strict=True):
                h = ops.add_rms_norm(x, delta, layer.input_norm, eps, matmul_dtype)
                q = ops.rope_write(layer.qkv(h), batch.positions, batch.slot_mapping, cache,
                                   c.num_heads)
                attn = paged_attention(q, cache, plan, self._attend, attend_fixed)
                h = ops.add_rms_norm(x, layer.o(attn), layer.post_norm, eps, matmul_dtype)
                delta = layer.down(ops.silu_mul(layer.gate_up(h)))

        rows = x.index_select(0, batch.logits_indices)
        rows = ops.add_rms_norm(rows, delta.index_select(0, batch.logits_indices),
                                self.final_norm, eps, rows.dtype)
        return self.lm_head(rows).float()

    __call__ = forward

    def _block_stack_for(self, plan: AttentionPlan) -> cpu_kernels.BlockStack | None:
        """The block stack this step runs, if any: every row on the fixed-order attention, in
        row order, and no more rows than the stack's matmuls take (the blocks' limit)."""
        if (plan.fixed is None or plan.decode_chunks or plan.prefills
                or not isinstance(plan.fixed.rows, slice)
                or plan.fixed.rows != slice(0, plan.num_tokens)):
            return None
        return next((stack for rows, stack in self.block_stacks if plan.num_tokens <= rows), None)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """The paged KV cache: one ``[num_blocks, block_size, 2, kv_heads, head_dim]`` tensor per layer."""
    return _allocate(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        num_blocks,
        block_size,
        dtype,
        device,
    )


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes one block takes across all layers (to size the cache from a memory budget)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * block_size * 2 * config.num_kv_heads * config.head_dim * itemsize
