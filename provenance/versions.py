"""What the truth layer's reads and writes carry: a source's chunked content going in, its
versions, chunks and snapshots coming out, and the ids and hashes that name them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from provenance.hashing import blake3_hex
from provenance.models import OPEN_EPOCH, Chunk, SourceVersion

# Fixed namespace of chunk ids: uuid5(namespace, "tenant␟source␟version␟ordinal").
CHUNK_ID_NAMESPACE = uuid.UUID("6f1c2d0e-8a4b-5e7f-9c3d-2b1a0e9f8d7c")

SessionFactory = Callable[[], Session]


def content_hash(text: str) -> str:
    """BLAKE3 (hex) of normalized text: the identity of a version's content and of a chunk."""
    return blake3_hex(text)


def chunk_id(tenant_id: str, source_id: str, version: int, ordinal: int) -> str:
    return str(
        uuid.uuid5(CHUNK_ID_NAMESPACE, f"{tenant_id}\x1f{source_id}\x1f{version}\x1f{ordinal}")
    )


@dataclass(frozen=True, slots=True)
class ChunkDraft:
    """One chunk of a version about to be written; ``text`` is the slice
    ``normalized_text[char_start:char_end]``."""

    ordinal: int
    text: str
    chunk_hash: str
    token_count: int
    char_start: int
    char_end: int


@dataclass(frozen=True, slots=True)
class SourceDraft:
    """A source's normalized content, chunked, ready for ``commit``."""

    source_id: str
    uri: str
    kind: str
    content_hash: str
    chunks: tuple[ChunkDraft, ...]
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    tenant_id: str
    source_id: str
    version: int
    content_hash: str
    valid_from: int
    valid_to: int  # OPEN_EPOCH while the version is current
    status: str  # active | superseded | deprecated | deleted
    ingested_at: datetime
    title: str
    metadata: dict[str, Any]

    @property
    def is_open(self) -> bool:
        return self.valid_to == OPEN_EPOCH

    @classmethod
    def of(cls, row: SourceVersion) -> VersionInfo:
        return cls(
            tenant_id=row.tenant_id,
            source_id=row.source_id,
            version=row.version,
            content_hash=row.content_hash,
            valid_from=row.valid_from_epoch,
            valid_to=row.valid_to_epoch,
            status=row.status,
            ingested_at=row.ingested_at,
            title=row.title,
            metadata=dict(row.meta or {}),
        )


@dataclass(frozen=True, slots=True)
class SourceInfo:
    tenant_id: str
    source_id: str
    uri: str
    kind: str
    created_at: datetime
    latest: VersionInfo  # the newest version, open or closed

    @property
    def status(self) -> str:
        return self.latest.status


@dataclass(frozen=True, slots=True)
class ChunkRecord(ChunkDraft):
    """A chunk as stored: its draft, and the version it belongs to."""

    id: str
    tenant_id: str
    source_id: str
    version: int

    @classmethod
    def of(cls, row: Chunk) -> ChunkRecord:
        """The row's fields of the same names."""
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a tenant's store showed at one epoch."""

    tenant_id: str
    epoch: int
    versions: tuple[VersionInfo, ...]
