"""SQL tables of the truth, memory and audit layers (SQLAlchemy 2 declarative models).

SQL is the source of truth. The vector index only mirrors what a committed epoch made visible.
A version is visible at epoch E iff ``valid_from_epoch <= E < valid_to_epoch``; an open version
has ``valid_to_epoch == OPEN_EPOCH`` so the same range test works in SQL and in vector filters.
"""

from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Largest epoch a signed 64-bit payload can hold: "never closed".
OPEN_EPOCH = 2**63 - 1


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """The same instant in UTC (a naive time is taken as UTC). Compare times in UTC: SQLite
    stores DateTime columns as UTC wall-clock text and compares text, so a bound with another
    offset (``...+05:00``) would be off by that offset there, while PostgreSQL compares instants."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    # BLAKE3 of the secret; the secret itself is shown once and never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[Any]] = mapped_column(JSON)
    name: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Epoch(Base):
    """One commit of a tenant's truth store. Every ingestion commit adds exactly one row.

    Epochs count per tenant: one tenant's commits never move another's epoch.
    """

    __tablename__ = "epochs"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    committed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    job_id: Mapped[str | None] = mapped_column(String(32))
    summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class EpochCounter(Base):
    """One row per tenant that its writers lock to take the next epoch (SELECT ... FOR UPDATE
    semantics).

    Its row lock, held until the writer commits, also serializes the tenant's write window in
    which vector points exist before their SQL rows, so a sweep of the tenant that takes the same
    lock never mistakes an in-flight commit's points for orphans. Writers of other tenants lock
    other rows and do not wait.
    """

    __tablename__ = "epoch_counter"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class Source(Base):
    __tablename__ = "sources"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    id: Mapped[str] = mapped_column(String(512), primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SourceVersion(Base):
    __tablename__ = "source_versions"
    __table_args__ = (
        ForeignKeyConstraint(["tenant_id", "source_id"], ["sources.tenant_id", "sources.id"]),
        Index("ix_source_versions_visibility", "tenant_id", "valid_from_epoch", "valid_to_epoch"),
    )
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    source_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    valid_from_epoch: Mapped[int] = mapped_column(BigInteger)
    valid_to_epoch: Mapped[int] = mapped_column(BigInteger, default=OPEN_EPOCH)
    ingested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # active | superseded | deprecated | deleted
    status: Mapped[str] = mapped_column(String(16), default="active")
    title: Mapped[str] = mapped_column(Text, default="")
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)


class Chunk(Base):
    __tablename__ = "chunks"
    __table_args__ = (
        ForeignKeyConstraint(
            ["tenant_id", "source_id", "version"],
            ["source_versions.tenant_id", "source_versions.source_id", "source_versions.version"],
        ),
        UniqueConstraint("tenant_id", "source_id", "version", "ordinal"),
    )
    # Deterministic UUID from (tenant, source, version, ordinal): a re-run writes the same ids,
    # so a crashed ingestion converges instead of duplicating chunks or vector points.
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    source_id: Mapped[str] = mapped_column(String(512))
    version: Mapped[int] = mapped_column(Integer)
    ordinal: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    chunk_hash: Mapped[str] = mapped_column(String(64), index=True)
    token_count: Mapped[int] = mapped_column(Integer)
    char_start: Mapped[int] = mapped_column(Integer)
    char_end: Mapped[int] = mapped_column(Integer)


class Embedding(Base):
    """One vector per (chunk text hash, embedding model): identical chunks are embedded once."""

    __tablename__ = "embeddings"
    chunk_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    vector: Mapped[bytes] = mapped_column(LargeBinary)


class Upload(Base):
    """Bytes a tenant uploaded for ingestion, content-addressed, until their job succeeds. They
    live in the database, not on one replica's disk, so any worker can read them."""

    __tablename__ = "uploads"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    blake3: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class IngestionJob(Base):
    __tablename__ = "ingestion_jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    # queued | running | succeeded | failed
    state: Mapped[str] = mapped_column(String(16), default="queued")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    request: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    total_sources: Mapped[int] = mapped_column(Integer, default=0)
    done_sources: Mapped[int] = mapped_column(Integer, default=0)
    chunks_embedded: Mapped[int] = mapped_column(Integer, default=0)
    chunks_skipped: Mapped[int] = mapped_column(Integer, default=0)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    errors: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    celery_task_id: Mapped[str | None] = mapped_column(String(64))


class Receipt(Base):
    """A retrieval receipt: everything needed to explain and replay one answer."""

    __tablename__ = "receipts"
    # A tenant's receipts in the order reviewers page through them: a page reads its own rows
    # whatever other tenants wrote, and a receipt costs one index, not two.
    __table_args__ = (Index("ix_receipts_tenant_created", "tenant_id", "created_at", "id"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # ok | failed | cancelled
    status: Mapped[str] = mapped_column(String(16))
    snapshot_epoch: Mapped[int | None] = mapped_column(BigInteger)
    model_id: Mapped[str] = mapped_column(String(200))
    weights_hash: Mapped[str] = mapped_column(String(64))
    prompt_hash: Mapped[str] = mapped_column(String(64))
    output_hash: Mapped[str] = mapped_column(String(64))
    # The full receipt document (OpenTelemetry GenAI attribute names where one exists).
    body: Mapped[dict[str, Any]] = mapped_column(JSON)


class ReceiptRow(NamedTuple):
    """A receipt's row as the hot path writes it, without the ORM's bookkeeping (a mapped
    object's attribute events cost more than its INSERT): the receipts table's columns."""

    id: str
    tenant_id: str
    api_key_id: str | None
    created_at: datetime
    status: str
    snapshot_epoch: int | None
    model_id: str
    weights_hash: str
    prompt_hash: str
    output_hash: str
    # The body as canonical JSON text (provenance.hashing.canonical_json): stored as is, and
    # hashed as is by its audit leaf, so the hot path serializes it once.
    body: str


class ReceiptCitation(Base):
    """One source version a receipt cited: what "every answer that cited pricing.md v3" searches."""

    __tablename__ = "receipt_citations"
    __table_args__ = (
        Index("ix_receipt_citations_source", "tenant_id", "source_id", "version"),
    )
    receipt_id: Mapped[str] = mapped_column(ForeignKey("receipts.id"), primary_key=True)
    source_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))


class AuditLeaf(Base):
    """Append-only Merkle log per tenant (RFC 6962 shape, BLAKE3): receipts and truth-store events.

    ``seq`` is the leaf's index in its tenant's tree.
    """

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_tenant_ref", "tenant_id", "ref"),)
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    # receipt | version_opened | version_closed
    kind: Mapped[str] = mapped_column(String(32))
    ref: Mapped[str] = mapped_column(String(600))
    # The leaf's data: canonical JSON of kind, ref, payload and nonce is what leaf_hash commits to.
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Random, so a leaf hash cannot confirm a guess of the payload; NULL on leaves logged before
    # nonces existed (their data has no nonce field).
    nonce: Mapped[str | None] = mapped_column(String(32))
    leaf_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AuditNode(Base):
    """The hash of one complete subtree of a tenant's log, written when its last leaf is appended:
    subtree (level, index) holds leaves [index * 2^level, (index + 1) * 2^level), level >= 1
    (level 0 is ``audit_log.leaf_hash``), and is keyed by ``merkle.node_number(level, index)``.
    Roots and proofs read O(log n) of these instead of every leaf."""

    __tablename__ = "audit_nodes"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    node: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    hash: Mapped[str] = mapped_column(String(64))


class AuditHead(Base):
    """A tenant's log size and frontier (the roots of the complete subtrees that cover it, largest
    first). Appenders lock this row, which serializes a tenant's appends in any process."""

    __tablename__ = "audit_heads"
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    frontier: Mapped[list[Any]] = mapped_column(JSON)
