"""What the API needs at hand, built once at start-up from its settings: the engine, the tokenizer,
the embedder, the vector index, and a metrics registry. Tests build one with their own parts."""

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from engine.config import EngineConfig
from gateway.metrics import GatewayMetrics
from gateway.settings import ServerSettings
from ingest.embedding import Embedder
from ingest.jobs import Runtime
from provenance import memory
from provenance.receipt_writer import ReceiptWriter
from provenance.truth import current_epoch


class _NotNeeded(Exception):
    """Raised on the engine thread in place of a query embedding nobody needs any more."""


@dataclass(slots=True)
class Timings:
    """Where a request's time went before and after the engine, in seconds (Server-Timing)."""

    embed: float = 0.0
    retrieve: float = 0.0
    prompt: float = 0.0
    engine: float = 0.0
    receipt: float = 0.0
    started_ns: int = field(default_factory=time.time_ns)  # wall clock, for the trace

    def header(self) -> str:
        return ", ".join(
            f"{name};dur={value * 1000:.2f}"
            for name, value in asdict(self).items()
            if name != "started_ns"
        )


@dataclass(slots=True)
class PreparedPrompt:
    messages: list[dict[str, str]]  # the conversation as the model sees it (template applied)
    prompt_text: str
    prompt_ids: list[int]
    retrieval: memory.Retrieval | None  # None when the request turned retrieval off
    chunks: list[memory.RetrievedChunk]  # the chunks that made it into the prompt
    timings: Timings = field(default_factory=Timings)


@dataclass
class Services:
    settings: ServerSettings
    engine: Any  # engine.AsyncEngine
    tokenizer: Any  # engine.Tokenizer
    # Ingestion's runtime, the same embedder and sessions: the admin routes' jobs run on it.
    runtime: Runtime
    index: Any  # what retrieval searches: runtime.index, or a caught-up view of it
    model_id: str
    weights_hash: str
    engine_numerics: dict[str, Any]  # the engine settings that affect output bits
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # Keeps this replica's embedded index caught up with the truth layer (several processes).
    catch_up: Any = None  # provenance.projection.CatchUpLoop | None
    receipts: ReceiptWriter = field(init=False)  # receipt commits (provenance/receipt_writer.py)
    tracer: Any = field(default_factory=trace.NoOpTracer)  # gateway/tracing.py

    def __post_init__(self) -> None:
        self.receipts = ReceiptWriter(
            self.settings.sqlalchemy_url, self.settings.receipt_commit_timeout_s
        )
        self.metrics = GatewayMetrics(self.registry)
        # Fitting the context budget measures every retrieved chunk in tokens; a chunk's text
        # never changes and similar questions cite the same chunks (4,096 remembered).
        self._token_counts = lru_cache(maxsize=4096)(lambda text: len(self.tokenizer.encode(text)))
        # Retrieval runs at committed epochs only (a later snapshot is refused), whose truth
        # never changes: what SQL said of a chunk there is remembered.
        self.visibility = memory.VisibilityCache()

    async def start(self) -> None:
        """The engine thread starts with the AsyncEngine; the catch-up loop starts here."""
        if self.catch_up is not None:
            self.catch_up.start()

    async def stop(self) -> None:
        if self.catch_up is not None:
            self.catch_up.stop()
        self.engine.shutdown()
        self.receipts.close()  # the receipts of the last requests (cancelled ones too) land

    def healthy(self) -> bool:
        return self.engine.is_healthy()

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.max_model_len

    @property
    def served_model_names(self) -> set[str]:
        return {self.model_id, "inherent"}

    @property
    def embedder(self) -> Embedder:
        return self.runtime.embedder

    @property
    def embedding_model_name(self) -> str:
        """The embedder's name (its model_id without the weights hash)."""
        return self.embedder.model_id.partition("@")[0]

    def embed_query(self, query: str, meanwhile: Callable[[], object] | None = None,
                    needed: Callable[[], bool] = lambda: True) -> tuple[np.ndarray | None, float]:
        """The query's embedding, and the seconds until it was ready. It is computed on the
        engine thread between two steps: from this thread it would start a second OpenMP team on
        the engine's cores (engine/async_engine.py). `meanwhile` runs on this thread while it
        waits; should `needed()` say no by the time the engine thread comes to it, the forward
        is skipped and the embedding is None."""
        submitted = time.perf_counter()
        ready_at: list[float] = []

        def run_forward(forward: Callable[[], Any]) -> Any:
            def timed() -> Any:
                if not needed():
                    raise _NotNeeded
                out = forward()
                ready_at.append(time.perf_counter())
                return out

            return self.engine.run_between_steps(timed, meanwhile=meanwhile)

        try:
            vector = self.embedder.embed([query], run_forward=run_forward)[0]
        except _NotNeeded:
            return None, time.perf_counter() - submitted
        return vector, ready_at[-1] - submitted

    def completion_prompt(self, prompt: str | list[int]) -> PreparedPrompt:
        """A text completion's prompt as sent: text is tokenized as the engine would (BOS
        included); token ids pass unchanged, their text decoded for the receipt's hash."""
        if isinstance(prompt, str):
            return PreparedPrompt([], prompt, self.tokenizer.encode(prompt), None, [])
        vocab = self.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        return PreparedPrompt([], text, list(prompt), None, [])

    def count_tokens(self, text: str) -> int:
        return self._token_counts(text)

    def render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)

    def prepare(
        self,
        session: Session | Connection,
        tenant_id: str,
        messages: list[dict[str, str]],
        use_retrieval: bool,
        snapshot: int | None,
        top_k: int | None,
    ) -> PreparedPrompt:
        """Retrieve at the snapshot, fit the context budget, apply the template, tokenize."""
        retrieval = None
        chunks: list[memory.RetrievedChunk] = []
        timings = Timings()
        if use_retrieval:
            start = time.perf_counter()
            query = memory.retrieval_query(messages)
            # The snapshot (a first statement: the session's connection and BEGIN too) resolves
            # while the engine thread embeds the query. Retrieval's time is what it adds beyond
            # the embedding's: the rest of the snapshot's, if it outlasted the embedding.
            # A tenant that never committed an epoch has nothing to search: its query is not
            # embedded, if the snapshot is known by the time the engine thread comes to it (a
            # 400-token question's embedding took 9 % of the engine thread under load).
            epochs: list[int] = []
            vector, timings.embed = self.embed_query(
                query, meanwhile=lambda: epochs.append(current_epoch(session, tenant_id)),
                needed=lambda: epochs != [0])
            current = epochs[0]
            if snapshot is None:
                snapshot = current
            elif snapshot > current:
                raise memory.UnknownSnapshot(
                    f"snapshot {snapshot} does not exist yet; the current epoch is {current}"
                )
            if current == 0:  # what a search of the empty snapshot returns
                retrieval = memory.Retrieval(query, tenant_id, snapshot, self.embedder.model_id, ())
            else:
                retrieval = memory.retrieve(
                    session,
                    self.embedder,
                    self.index,
                    query,
                    tenant_id,
                    snapshot,
                    top_k or self.settings.retrieval_top_k,
                    vector,
                    self.settings.retrieval_min_score,
                    self.visibility,
                )
            chunks = memory.fit_to_budget(
                retrieval.chunks, self.settings.context_token_budget, self.count_tokens
            )
            timings.retrieve = time.perf_counter() - start - timings.embed
            self.metrics.observe(
                timings.embed, timings.retrieve, len(retrieval.chunks), len(chunks)
            )
        start = time.perf_counter()
        prepared = self.prompt_from_chunks(messages, retrieval, chunks)
        timings.prompt = time.perf_counter() - start
        prepared.timings = timings
        return prepared

    def prompt_from_chunks(self, messages, retrieval, chunks) -> PreparedPrompt:
        final = memory.build_messages(messages, chunks)
        text, ids = self.render(final)
        return PreparedPrompt(final, text, ids, retrieval, list(chunks))


def build_services(settings: ServerSettings, registry: CollectorRegistry) -> Services:
    """Load the model, the embedder and the vector index named by the settings."""
    from engine import AsyncEngine, create_engine
    from engine.openmp import release_thread_pool

    # The cores are the engine's: tokenizers' own thread pool would take each batch call (the
    # prompt's, a query's) to one of its threads and wake the caller after, so they run here.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    llm = create_engine(settings.engine, registry)
    runtime = Runtime(settings)
    index = runtime.index
    catch_up = None
    if settings.redis_url and not settings.qdrant_url:
        # Workers commit elsewhere and no server index is shared: this replica's embedded
        # index is a projection of the truth layer, caught up now (before /readyz says ready)
        # and then before every search and in the background.
        from provenance.projection import CatchUpLoop, CaughtUpSearch, IndexProjection

        projection = IndexProjection(
            runtime.sessions,
            index,
            runtime.embedder.model_id,
            settings.embedded_index_dir / f"{settings.collection}.applied.json",
        )
        projection.catch_up_all()
        catch_up = CatchUpLoop(projection, settings.index_sync_interval_s)
        index = CaughtUpSearch(projection)
    services = Services(
        settings=settings,
        engine=AsyncEngine(llm),
        tokenizer=llm.tokenizer,
        runtime=runtime,
        index=index,
        model_id=settings.served_model_name or llm.model_id,
        weights_hash=llm.weights_hash,
        engine_numerics=numerics(settings.engine),
        registry=registry,
        catch_up=catch_up,
    )
    # From here on the engine thread runs this process's torch work, and only its OpenMP team
    # may hold the cores (engine/openmp.py): loading left this thread a team of its own, and
    # an ingestion job's or /v1/embeddings' thread keeps none between two forwards.
    runtime.embedder.after_forward = release_thread_pool
    release_thread_pool()
    return services


def numerics(config: EngineConfig) -> dict[str, Any]:
    """The engine settings that can change output bits, as receipts record them."""
    import torch

    from engine.model import default_kv_cache_dtype, default_matmul_dtype

    dtype = getattr(torch, config.dtype)
    kv_dtype = default_kv_cache_dtype(config.kv_cache_dtype, dtype, config.device)
    return {
        "dtype": config.dtype,
        "matmul_dtype": str(default_matmul_dtype(dtype, config.device)).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "device": config.device,
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "enable_prefix_caching": config.enable_prefix_caching,
        "batch_invariant": config.batch_invariant,
    }
