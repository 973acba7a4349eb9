"""uploads: a tenant's uploaded bytes, content-addressed, until their ingestion job succeeds

Revision ID: 0005_uploads
Revises: 0004_receipt_citations
Create Date: 2026-11-30 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_uploads"
down_revision: str | None = "0004_receipt_citations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("blake3", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("tenant_id", "blake3"),
    )


def downgrade() -> None:
    op.drop_table("uploads")
