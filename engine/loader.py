"""Load a model's config, weights and tokenizer from a GGUF file or a Hugging Face folder.

Both paths end in the same :class:`Checkpoint`: a :class:`ModelConfig`, float tensors under
Hugging Face Llama names (Q/K in transformers' RoPE layout), a :class:`Tokenizer`, and the
BLAKE3 ``weights_hash`` that receipts record. A GGUF's Q4_1 and Q8_0 matrices also come as
their blocks, as stored (:class:`GGUFBlocks`), for the matmul kernel that reads them directly.

GGUF: the first load parses the file, dequantizes every tensor (``gguf.quants.dequantize``: Q4_0,
Q4_1, Q8_0, K-quants, F16, BF16, F32, ...), undoes llama.cpp's Q/K row permutation, builds the
tokenizer from the embedded vocabulary, and writes all of it as a Hugging Face folder
(config.json, model.safetensors, tokenizer files) under ``<cache>/<blake3 of the GGUF>/``. Later
loads read that folder. The cache folder is also a valid transformers checkpoint.

We parse the GGUF header ourselves: ``gguf.GGUFReader`` builds a numpy view per string of the
vocabulary (~5 s for a 49k vocabulary); reading the same bytes with ``struct`` takes ~0.1 s.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from engine.model import ModelConfig
from engine.tokenizer import Tokenizer

CACHE_ENV = "INHERENT_MODEL_CACHE"
SOURCE_FILE = "inherent_source.json"  # in a GGUF's cache folder: the GGUF's hash and model id
_CACHE_FORMAT = 1  # bump when what the cache holds changes

_GGUF_MAGIC = b"GGUF"
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


# GGUF block types whose blocks the engine's matmul kernel reads (engine/csrc/quant_linear.cpp)
BLOCK_TYPES = ("Q4_1", "Q8_0")


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """A matrix as its GGUF blocks: ``blocks`` [out_features, in_features / 32 * block bytes]
    uint8, rows in the file's order. For Q and K that is llama.cpp's order (RoPE pairs side by
    side), which is the model's own layout (engine/model.py); the dense Q/K in ``weights`` are
    in transformers' order."""

    qtype: str  # one of BLOCK_TYPES
    blocks: torch.Tensor
    in_features: int


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names
    tokenizer: Tokenizer
    weights_hash: str  # BLAKE3 hex of the GGUF file, or of the safetensors files in name order
    model_id: str
    path: Path  # the GGUF file or the folder it was loaded from
    # a GGUF's Q4_1/Q8_0 matrices as stored, under the same names (empty for other sources)
    quantized: dict[str, GGUFBlocks] = field(default_factory=dict)


# --- hashing ---------------------------------------------------------------------------------


def blake3_files(paths: Iterable[Path]) -> str:
    """BLAKE3 of the files' bytes, concatenated in the order given."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for path in paths:
        if os.path.getsize(path):  # mmap refuses empty files
            hasher.update_mmap(str(path))
    return hasher.hexdigest()


# --- GGUF parsing ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/torch order (GGUF stores it innermost first)
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data: mmap.mmap

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored bytes, as ``dequantize`` expects them: [rows, bytes per row]."""
        flat = np.frombuffer(self.data, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return flat.reshape(rows, -1)

    def dequantize(self, info: GGUFTensorInfo) -> torch.Tensor:
        values = dequantize(self.raw(info), info.qtype).astype(np.float32, copy=False)
        if not values.flags.writeable:  # F32 tensors are views of the read-only mapping
            values = values.copy()
        return torch.from_numpy(values.reshape(info.shape))


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        start, self.pos = self.pos, self.pos + length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                return [self.value(item_type) for _ in range(count)]
            fmt = _SCALAR_FORMATS[GGUFValueType(item_type)]
            items = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
            self.pos += items.nbytes
            return items.tolist()
        return self.scalar(_SCALAR_FORMATS[GGUFValueType(vtype)])


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata and tensor directory of a little-endian GGUF v2/v3 file; data stays mapped."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(data)
    if data[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3; little-endian)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        qtype = GGMLQuantizationType(cur.scalar("<I"))
        offset = cur.scalar("<Q")
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block_elems * block_bytes
        infos.append((name, tuple(reversed(dims)), qtype, offset, nbytes))
    alignment = metadata.get("general.alignment", 32)
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = [GGUFTensorInfo(n, s, q, data_start + o, b) for n, s, q, o, b in infos]
    return GGUFFile(metadata, tensors, data)


# --- GGUF -> Hugging Face names and config -----------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str:
    """Our (Hugging Face) name for a llama-architecture GGUF tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (RoPE pairs adjacent) back to transformers' (pairs half a
    head apart). llama.cpp's converter maps row ``h, half, i`` to ``h, i, half``; we invert it."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, -1)
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def config_from_gguf(meta: Mapping[str, Any], tensor_names: Iterable[str]) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama)")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length") or hidden // heads
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    scaling = None
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise ValueError(f"GGUF RoPE scaling {scaling_type!r} is not supported")
    vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in set(tensor_names),
        rope_scaling=scaling,
    )


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, threads: int | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under our names, Q/K back in transformers' order."""

    def convert(info: GGUFTensorInfo) -> tuple[str, torch.Tensor]:
        name = hf_name(info.name)
        tensor = gguf.dequantize(info)
        if name.endswith("q_proj.weight"):
            tensor = unpermute_rope_rows(tensor, config.num_heads)
        elif name.endswith("k_proj.weight"):
            tensor = unpermute_rope_rows(tensor, config.num_kv_heads)
        return name, tensor.contiguous()

    # numpy releases the GIL in the dequantization kernels: threads help
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        return dict(pool.map(convert, gguf.tensors))


# --- loading ---------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inherent" / "models"


def load_checkpoint(path: str | Path, *, cache_dir: str | Path | None = None) -> Checkpoint:
    """A GGUF file or a Hugging Face folder."""
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path)
    return load_gguf(path, cache_dir=cache_dir)


def load_gguf(path: str | Path, *, cache_dir: str | Path | None = None) -> Checkpoint:
    """Load a llama GGUF, dequantized to float32, through the per-file cache."""
    path = Path(path)
    weights_hash = blake3_files([path])
    model_id = path.name.removesuffix(".gguf")
    folder = Path(cache_dir or default_cache_dir()) / f"{weights_hash}-v{_CACHE_FORMAT}"
    if not (folder / SOURCE_FILE).is_file():
        _convert_gguf(path, folder, weights_hash, model_id)
    checkpoint = load_hf_dir(folder, weights_hash=weights_hash, model_id=model_id)
    checkpoint.path = path
    checkpoint.quantized = gguf_blocks(read_gguf(path))
    return checkpoint


def gguf_blocks(gguf: GGUFFile) -> dict[str, GGUFBlocks]:
    """The file's 2-D tensors of a block type in BLOCK_TYPES, copied out of the mapping."""
    found = {}
    for info in gguf.tensors:
        if len(info.shape) == 2 and info.qtype.name in BLOCK_TYPES:
            blocks = torch.from_numpy(gguf.raw(info).copy())
            found[hf_name(info.name)] = GGUFBlocks(info.qtype.name, blocks, info.shape[1])
    return found


def _convert_gguf(path: Path, folder: Path, weights_hash: str, model_id: str) -> None:
    """Write the GGUF as a Hugging Face folder; atomic (written aside, then renamed)."""
    gguf = read_gguf(path)
    config = config_from_gguf(gguf.metadata, (t.name for t in gguf.tensors))
    weights = gguf_weights(gguf, config)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)

    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(weights, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        (scratch / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
        tokenizer.save(scratch)
        source = {
            "format": "gguf",
            "source": str(path),
            "weights_hash": weights_hash,
            "model_id": model_id,
        }
        (scratch / SOURCE_FILE).write_text(json.dumps(source, indent=1))
        try:
            scratch.rename(folder)
        except OSError:  # another process finished first: theirs is as good as ours
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_hf_dir(
    path: str | Path, *, weights_hash: str | None = None, model_id: str | None = None
) -> Checkpoint:
    """A Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json.

    ``weights_hash`` defaults to the BLAKE3 of the safetensors files in name order, ``model_id``
    to the folder's name.
    """
    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    missing = [n for n in _required_names(config) if n not in weights]
    if missing:
        raise ValueError(
            f"{path}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}"
        )
    eos = hf_config.get("eos_token_id")
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id", eos)
    extra_eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    tokenizer = Tokenizer.from_dir(path, extra_eos_token_ids=extra_eos)
    return Checkpoint(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        weights_hash=weights_hash or blake3_files(files),
        model_id=model_id or path.name,
        path=path,
    )


def _required_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{w}_proj.weight" for w in "qkvo"]
        names += [p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
    return names
