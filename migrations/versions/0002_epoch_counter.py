"""epoch counter: one row that writers lock to allocate the next epoch

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "epoch_counter",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    # Seed from the epochs already committed, so upgrading a live store continues its sequence.
    op.execute(
        "INSERT INTO epoch_counter (id, value) SELECT 1, COALESCE(MAX(epoch), 0) FROM epochs"
    )


def downgrade() -> None:
    op.drop_table("epoch_counter")
