"""The truth layer: source versions as MVCC over epochs. This module is its front door; the
layer lives in ``versions`` (values in and out), ``snapshots`` (reads), ``epoch_commit`` (the
writer), ``writers_lock``, ``sweep`` and ``embedding_cache``.

An epoch is one commit of the truth store. A version is visible at epoch E iff
``valid_from_epoch <= E < valid_to_epoch``. ``commit`` is the only writer: in ONE transaction
and ONE new epoch it opens a version for every source whose content changed (closing the one
it supersedes) and closes versions that are deprecated or deleted (tombstones: history stays).
Identical content (same BLAKE3) is a no-op that takes no epoch.

Epochs count per tenant: each tenant has its own counter row, so one tenant's commits neither
move another's epoch nor wait for another's writers.

Write order (vectors first, SQL last), under the tenant's writers' lock (``writers_lock``: a
PostgreSQL advisory lock, or a file lock beside the SQLite file), which admits one commit or
sweep of the tenant at a time across threads and processes and is held until the SQL commit:
1. a short read transaction plans the change and reads the tenant's epoch counter (next epoch =
   counter + 1; only a lock holder moves the counter, so the plan stays true);
2. with NO transaction open, the new versions' points are written with ``valid_from`` = that
   epoch (on SQLite a transaction held here would hold the database write lock, and receipt
   writes would wait behind the vector upsert);
3. one short write transaction takes the epoch (counter + 1, checked against step 1), writes the
   versions, chunks and audit leaves, and commits.
Only after the commit does it mark the closed versions' points (``valid_to``). A crash before
the commit leaves points no SQL row names (invisible: retrieval checks hits against SQL, and
``sweep`` deletes them); a crash after it leaves closed points still marked open (retrieval
drops them on the SQL check, ``sweep`` repairs the payload). Chunk ids are deterministic, so a
re-run writes the same points. ``sweep`` takes the same lock, reads SQL in a short transaction
and scans the index with none open, so it never mistakes an in-flight commit's points for
orphans and never blocks receipt writes while it scans.
"""

from provenance.embedding_cache import cached_vectors, store_vectors
from provenance.epoch_commit import (
    CLOSE_STATUSES,
    CommitResult,
    close_source,
    commit,
    ensure_tenant,
)
from provenance.snapshots import (
    as_of,
    chunks_as_of,
    current_epoch,
    epoch_at,
    get_chunks,
    latest_versions,
    list_sources,
    list_versions,
    open_content_hashes,
    open_source_ids,
)
from provenance.sweep import SweepReport, expected_points, sweep
from provenance.versions import (
    ChunkDraft,
    ChunkRecord,
    SessionFactory,
    Snapshot,
    SourceDraft,
    SourceInfo,
    VersionInfo,
    chunk_id,
    content_hash,
)
from provenance.writers_lock import writers_lock

__all__ = [
    "CLOSE_STATUSES",
    "ChunkDraft",
    "ChunkRecord",
    "CommitResult",
    "SessionFactory",
    "Snapshot",
    "SourceDraft",
    "SourceInfo",
    "SweepReport",
    "VersionInfo",
    "as_of",
    "cached_vectors",
    "chunk_id",
    "chunks_as_of",
    "close_source",
    "commit",
    "content_hash",
    "current_epoch",
    "ensure_tenant",
    "epoch_at",
    "expected_points",
    "get_chunks",
    "latest_versions",
    "list_sources",
    "list_versions",
    "open_content_hashes",
    "open_source_ids",
    "store_vectors",
    "sweep",
    "writers_lock",
]
