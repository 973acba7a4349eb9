"""Uploaded bytes held for ingestion: per tenant, content-addressed, in the database.

An upload is read only by a job of the tenant that sent it (the key includes the tenant), so
no path or name can reach another tenant's bytes. Bytes leave once a job that used them
succeeds: the truth layer then holds the text as source versions.
"""

from collections.abc import Iterable

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from provenance.hashing import blake3_hex
from provenance.models import IngestionJob, Upload

UNFINISHED_STATES = ("queued", "running")


class UploadMissing(LookupError):
    """The job names bytes the store no longer has (a job that already succeeded used them)."""


def store(session: Session, tenant_id: str, data: bytes) -> str:
    """Keep ``data`` for the tenant; its BLAKE3 hex (the same bytes are kept once)."""
    digest = blake3_hex(data)
    if session.get(Upload, (tenant_id, digest)) is None:
        session.add(Upload(tenant_id=tenant_id, blake3=digest, size=len(data), data=data))
        session.flush()
    return digest


def read(session: Session, tenant_id: str, digest: str) -> bytes:
    row = session.get(Upload, (tenant_id, digest))
    if row is None:
        raise UploadMissing(digest)
    return row.data


def release(session: Session, tenant_id: str, digests: Iterable[str], job_id: str) -> None:
    """Drop the bytes ``job_id`` used, except those another unfinished job still needs."""
    digests = set(digests)
    pending = session.scalars(
        select(IngestionJob.request).where(
            IngestionJob.tenant_id == tenant_id,
            IngestionJob.state.in_(UNFINISHED_STATES),
            IngestionJob.id != job_id,
        )
    )
    for request in pending:
        digests -= {u["blake3"] for u in (request or {}).get("uploads", [])}
    if digests:
        session.execute(
            delete(Upload).where(Upload.tenant_id == tenant_id, Upload.blake3.in_(digests))
        )
