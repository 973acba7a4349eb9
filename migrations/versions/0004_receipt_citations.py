"""receipt citations: the source versions each receipt cited, searchable by source and version

Revision ID: 0004_receipt_citations
Revises: 0003_per_tenant_logs
Create Date: 2026-11-30 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_receipt_citations"
down_revision: str | None = "0003_per_tenant_logs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    citations = op.create_table(
        "receipt_citations",
        sa.Column("receipt_id", sa.String(length=32), nullable=False),
        sa.Column("source_id", sa.String(length=512), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["receipt_id"], ["receipts.id"]),
        sa.PrimaryKeyConstraint("receipt_id", "source_id", "version"),
    )
    op.create_index(
        "ix_receipt_citations_source",
        "receipt_citations",
        ["tenant_id", "source_id", "version"],
        unique=False,
    )
    # Backfill from the receipts already written: their bodies name every cited chunk.
    receipts = sa.table(
        "receipts", sa.column("id", sa.String), sa.column("tenant_id", sa.String),
        sa.column("body", sa.JSON),
    )
    connection = op.get_bind()
    rows = []
    for receipt_id, tenant_id, body in connection.execute(
        sa.select(receipts.c.id, receipts.c.tenant_id, receipts.c.body)
    ):
        cited = {(c["source_id"], c["version"]) for c in body.get("inherent.retrieval.chunks") or []}
        rows += [
            {"receipt_id": receipt_id, "source_id": s, "version": v, "tenant_id": tenant_id}
            for s, v in sorted(cited)
        ]
    if rows:
        op.bulk_insert(citations, rows)


def downgrade() -> None:
    op.drop_index("ix_receipt_citations_source", table_name="receipt_citations")
    op.drop_table("receipt_citations")
