"""``index_sources``: the one function that brings a tenant's store in line with its sources.

In the spirit of LangChain's ``index()``: normalize and hash each source, skip the ones whose
open version already has that content, chunk and embed the rest (each chunk text embedded at
most once per model, ever), commit them as new versions, and with ``cleanup="full"`` close the
sources under the prefix that the input no longer has. Unlike ``index()`` nothing is deleted:
a changed or removed source closes its version at an epoch and stays replayable.

Sources whose content is already the open version are set aside first; the changed ones go in
batches, each batch ONE epoch. A crash loses at most the batch in flight, and a re-run skips
what was committed (identical content is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from ingest.chunking import Chunker, normalize_text
from ingest.embedding import Embedder, TransformersEmbedder, embed_with_cache
from ingest.loaders import Document, LoadFailure
from ingest.loaders.validate import check
from provenance import truth
from provenance.models import Source
from provenance.settings import Settings
from provenance.truth import SessionFactory, SourceDraft
from provenance.vector_index import VectorIndex

Cleanup = Literal["full"] | None
MAX_SOURCE_ID = Source.id.type.length  # 512


@dataclass(slots=True)
class IndexProgress:
    """Handed to the progress callback after every batch (and once at the start)."""

    done: int
    total: int
    chunks_embedded: int
    chunks_skipped: int
    errors: dict[str, str]


@dataclass(slots=True)
class IndexResult:
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    deprecated: int = 0
    deleted: int = 0
    failed: int = 0
    skipped: int = 0  # files of a type no loader handles: neither loaded nor failed
    chunks_embedded: int = 0  # chunk texts that went through the model
    chunks_skipped: int = 0  # chunks of new versions whose vector was already cached
    errors: dict[str, str] = field(default_factory=dict)  # source id -> reason
    skips: dict[str, str] = field(default_factory=dict)  # skipped source id -> reason
    epochs: list[int] = field(default_factory=list)  # the epochs this run committed

    def counts(self) -> dict[str, int]:
        """The counters (every int field), as a job's summary records them."""
        return {name: value for name, value in asdict(self).items() if isinstance(value, int)}

    def absorb(self, commit: truth.CommitResult) -> None:
        self.added += len(commit.added)
        self.updated += len(commit.updated)
        self.unchanged += len(commit.unchanged)
        self.deprecated += len(commit.deprecated)
        self.deleted += len(commit.deleted)
        if commit.epoch is not None:
            self.epochs.append(commit.epoch)


def index_sources(
    documents: Sequence[Document],
    *,
    tenant_id: str,
    sessions: SessionFactory,
    embedder: Embedder,
    index: VectorIndex,
    chunker: Chunker,
    failures: Sequence[LoadFailure] = (),
    skipped: Sequence[LoadFailure] = (),
    cleanup: Cleanup = None,
    cleanup_prefix: str = "",
    progress: Callable[[IndexProgress], None] | None = None,
    batch_size: int = 64,
    job_id: str | None = None,
) -> IndexResult:
    """Index ``documents`` for a tenant and return what changed.

    ``failures`` are sources that did not load: they count as failed and, being present in the
    input, are never cleaned up; ``skipped`` (unsupported types) are counted apart and likewise
    kept. ``cleanup=None`` only adds and updates; ``cleanup="full"`` also
    deletes (tombstones) every open source whose id starts with ``cleanup_prefix`` and is
    missing from the input, in one epoch after the batches.
    """
    if cleanup not in (None, "full"):
        raise ValueError(f"cleanup must be None or 'full', not {cleanup!r}")
    result = IndexResult()
    total = len(documents) + len(failures) + len(skipped)
    for failure in failures:
        result.errors[failure.source_id] = failure.reason
    result.skips = {s.source_id: s.reason for s in skipped}
    result.skipped = len(result.skips)
    seen: dict[str, str] = {f.source_id: f.uri for f in [*skipped, *failures]}
    unique: list[Document] = []
    for doc in documents:
        if doc.source_id in seen:
            result.errors.setdefault(
                doc.source_id, f"duplicate source id (also from {seen[doc.source_id]})"
            )
        elif not 0 < len(doc.source_id) <= MAX_SOURCE_ID:
            result.errors[doc.source_id] = f"source id must be 1 to {MAX_SOURCE_ID} characters"
        # Documents built by callers, not the loaders, are checked too: one that cannot be
        # stored (a lone surrogate, NUL in its id) would otherwise fail its whole batch.
        elif isinstance(checked := check(doc), LoadFailure):
            result.errors[doc.source_id] = checked.reason
        else:
            seen[doc.source_id] = doc.uri
            unique.append(checked)
    # Set aside what is already the open version, so batches hold only changed sources.
    prepared = [_Prepared(doc, normalize_text(doc.text)) for doc in unique]
    with sessions() as session:
        current = truth.open_content_hashes(session, tenant_id, [p.doc.source_id for p in prepared])
    changed = [p for p in prepared if current.get(p.doc.source_id) != p.content_hash]
    result.unchanged += len(prepared) - len(changed)
    done = total - len(changed)

    def report() -> None:
        if progress is not None:
            progress(
                IndexProgress(
                    done, total, result.chunks_embedded, result.chunks_skipped, dict(result.errors)
                )
            )

    report()
    for start in range(0, len(changed), batch_size):
        batch = changed[start : start + batch_size]
        _index_batch(batch, result, tenant_id, sessions, embedder, index, chunker, job_id)
        done += len(batch)
        report()

    if cleanup == "full":
        with sessions() as session:
            missing = truth.open_source_ids(session, tenant_id, cleanup_prefix) - set(seen)
        if missing:
            result.absorb(
                truth.commit(
                    sessions,
                    index,
                    tenant_id,
                    closes=[(s, "deleted") for s in sorted(missing)],
                    job_id=job_id,
                )
            )
    result.failed = len(result.errors)
    return result


@dataclass(slots=True)
class _Prepared:
    doc: Document
    text: str  # normalized
    content_hash: str = ""

    def __post_init__(self) -> None:
        self.content_hash = truth.content_hash(self.text)


def _index_batch(
    batch: Sequence[_Prepared],
    result: IndexResult,
    tenant_id: str,
    sessions: SessionFactory,
    embedder: Embedder,
    index: VectorIndex,
    chunker: Chunker,
    job_id: str | None,
) -> None:
    """Chunk, embed (through the cache) and commit one batch of changed sources as one epoch."""
    drafts: list[SourceDraft] = []
    for item in batch:
        doc = item.doc
        try:
            chunks = chunker.chunk(item.text)
        except Exception as error:  # one bad source must not stop the job
            result.errors[doc.source_id] = f"chunking failed: {type(error).__name__}: {error}"
            continue
        if not chunks:
            result.errors[doc.source_id] = "empty document"
            continue
        drafts.append(
            SourceDraft(
                source_id=doc.source_id,
                uri=doc.uri,
                kind=doc.kind,
                content_hash=item.content_hash,
                chunks=tuple(chunks),
                title=doc.title,
                metadata=dict(doc.metadata),
            )
        )
    if not drafts:
        return
    texts = {c.chunk_hash: c.text for d in drafts for c in d.chunks}
    cached = embed_with_cache(sessions, embedder, texts, tenant_id=tenant_id)
    result.chunks_embedded += cached.embedded
    result.chunks_skipped += sum(len(d.chunks) for d in drafts) - cached.embedded
    # commit re-checks under the writers' lock: a source another writer just made identical
    # comes back as unchanged.
    result.absorb(
        truth.commit(
            sessions, index, tenant_id, upserts=drafts, vectors=cached.vectors, job_id=job_id
        )
    )


def chunker_for(embedder: TransformersEmbedder, settings: Settings) -> Chunker:
    """The chunker that fits ``embedder``: chunks of at most ``settings.chunk_tokens`` tokens,
    capped at what the model embeds whole, with ``settings.chunk_overlap`` tokens repeated
    between neighbours."""
    max_tokens = min(settings.chunk_tokens, embedder.max_chunk_tokens)
    return Chunker(embedder.tokenizer, max_tokens, min(settings.chunk_overlap, max_tokens // 2))
