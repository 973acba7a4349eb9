"""receipts by tenant and time: one index in the order a tenant's receipts are listed

The listing walked the receipts of every tenant in time order (ix_receipts_created_at) to find
one tenant's: on SQLite, 200,000 receipts of which a tenant had 3, a page took 21-44 ms, and
more as others wrote. One index on (tenant_id, created_at, id) reads just the page's rows and
replaces the two on tenant_id and on created_at, one fewer for every receipt to write.

On PostgreSQL the indexes are built and dropped CONCURRENTLY, outside the migration's
transaction: a plain build blocks every write to the table until it ends, and while a receipt
cannot be written its answer fails closed. A build cut short leaves an invalid index behind,
which a rerun drops first.

Revision ID: 0006_receipts_by_tenant
Revises: 0005_uploads
Create Date: 2026-12-06 00:30:00
"""

from collections.abc import Sequence
from contextlib import nullcontext

from alembic import op

revision: str = "0006_receipts_by_tenant"
down_revision: str | None = "0005_uploads"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEW = ("ix_receipts_tenant_created", ["tenant_id", "created_at", "id"])
OLD = [("ix_receipts_tenant_id", ["tenant_id"]), ("ix_receipts_created_at", ["created_at"])]


def upgrade() -> None:
    with _without_blocking_writes():
        _build(*NEW)
        for name, _ in OLD:
            op.drop_index(name, table_name="receipts", postgresql_concurrently=True)


def downgrade() -> None:
    with _without_blocking_writes():
        for name, columns in OLD:
            _build(name, columns)
        op.drop_index(NEW[0], table_name="receipts", postgresql_concurrently=True)


def _build(name: str, columns: list[str]) -> None:
    op.drop_index(name, table_name="receipts", if_exists=True, postgresql_concurrently=True)
    op.create_index(name, "receipts", columns, postgresql_concurrently=True)


def _without_blocking_writes():
    """PostgreSQL builds an index CONCURRENTLY only outside a transaction; SQLite's write lock
    is the whole database's for any build, so there it stays in the migration's transaction."""
    postgresql = op.get_bind().dialect.name == "postgresql"
    return op.get_context().autocommit_block() if postgresql else nullcontext()
