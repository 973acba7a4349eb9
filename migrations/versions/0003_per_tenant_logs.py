"""per-tenant audit logs with stored subtree hashes, leaf nonces, and per-tenant epochs

The single global audit log becomes one RFC 6962 tree per tenant: each leaf moves to its
tenant's log (renumbered from 0 in the global order), and every tenant's complete subtree hashes
(``audit_nodes``) and frontier (``audit_heads``) are built from the leaf hashes, which stay as
they were (leaves logged before this revision carry no nonce). Epochs become per tenant: every
epoch row keeps its number and belongs to the tenant that committed it, and each tenant's counter
starts at its own last epoch, so versions' epoch bounds, receipts' snapshot epochs and vector
payloads stay valid as they are. Rows without a tenant (no code path writes them) go to the
tenant ``''``.

Downgrading refuses, naming why, when the data does not fit the old schema: leaves with a nonce
(the old verifier would call them tampered) or one epoch number used by two tenants.

Revision ID: 0003_per_tenant_logs
Revises: 0002
Create Date: 2026-11-30 16:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from provenance import merkle

revision: str = "0003_per_tenant_logs"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 10_000  # leaves hashed and subtrees inserted per round while building the trees


def _set_aside(table: str, indexes: Sequence[str]) -> str:
    """Rename ``table`` out of the way; its index names must be freed for the new table first
    (PostgreSQL names them per schema)."""
    for index in indexes:
        op.drop_index(index, table_name=table)
    aside = f"{table}_prev"
    op.rename_table(table, aside)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER INDEX {table}_pkey RENAME TO {aside}_pkey")
    return aside


def _audit_log_table(tenant_key: sa.PrimaryKeyConstraint, *extra: sa.Column) -> None:
    op.create_table(
        "audit_log",
        *extra,
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("ref", sa.String(length=600), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("leaf_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        tenant_key,
    )


def _build_trees(bind: sa.Connection) -> None:
    """Every tenant's stored subtrees and frontier, from its leaf hashes in order."""
    nodes = sa.table("audit_nodes", sa.column("tenant_id"), sa.column("node"), sa.column("hash"))
    heads = sa.table("audit_heads", sa.column("tenant_id"), sa.column("size"), sa.column("frontier", sa.JSON()))
    tenants = bind.execute(sa.text("SELECT DISTINCT tenant_id FROM audit_log ORDER BY tenant_id"))
    for (tenant_id,) in tenants.fetchall():
        frontier: list[bytes] = []
        size = 0
        while True:
            batch = [
                bytes.fromhex(digest)
                for (digest,) in bind.execute(
                    sa.text(
                        "SELECT leaf_hash FROM audit_log WHERE tenant_id = :t AND seq >= :start "
                        "ORDER BY seq LIMIT :n"
                    ),
                    {"t": tenant_id, "start": size, "n": BATCH},
                )
            ]
            if not batch:
                break
            frontier, completed = merkle.extend(frontier, size, batch)
            size += len(batch)
            if completed:
                bind.execute(
                    nodes.insert(),
                    [
                        {
                            "tenant_id": tenant_id,
                            "node": merkle.node_number(level, index),
                            "hash": h.hex(),
                        }
                        for level, index, h in completed
                    ],
                )
        bind.execute(
            heads.insert(),
            [{"tenant_id": tenant_id, "size": size, "frontier": [h.hex() for h in frontier]}],
        )


def upgrade() -> None:
    bind = op.get_bind()

    # Audit log: one tree per tenant.
    aside = _set_aside("audit_log", ["ix_audit_log_ref"])
    _audit_log_table(
        sa.PrimaryKeyConstraint("tenant_id", "seq"),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("nonce", sa.String(length=32), nullable=True),
    )
    op.execute(
        "INSERT INTO audit_log (tenant_id, seq, kind, ref, payload, nonce, leaf_hash, created_at) "
        "SELECT COALESCE(tenant_id, ''), "
        "ROW_NUMBER() OVER (PARTITION BY COALESCE(tenant_id, '') ORDER BY seq) - 1, "
        f"kind, ref, payload, NULL, leaf_hash, created_at FROM {aside}"
    )
    op.drop_table(aside)
    op.create_index("ix_audit_log_tenant_ref", "audit_log", ["tenant_id", "ref"], unique=False)
    op.create_table(
        "audit_nodes",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "node"),
    )
    op.create_table(
        "audit_heads",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("frontier", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    _build_trees(bind)

    # Epochs: numbered per tenant from here on; past epochs keep their numbers.
    aside = _set_aside("epochs", ["ix_epochs_committed_at"])
    op.create_table(
        "epochs",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "epoch"),
    )
    op.execute(
        "INSERT INTO epochs (tenant_id, epoch, committed_at, job_id, summary) "
        f"SELECT COALESCE(tenant_id, ''), epoch, committed_at, job_id, summary FROM {aside}"
    )
    op.drop_table(aside)
    op.create_index("ix_epochs_committed_at", "epochs", ["committed_at"], unique=False)
    op.drop_table("epoch_counter")
    op.create_table(
        "epoch_counter",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    op.execute(
        "INSERT INTO epoch_counter (tenant_id, value) "
        "SELECT tenant_id, MAX(epoch) FROM epochs GROUP BY tenant_id"
    )


def _refuse_if(bind: sa.Connection, query: str, why: str) -> None:
    count = bind.execute(sa.text(query)).scalar()
    if count:
        raise RuntimeError(f"cannot downgrade below 0003_per_tenant_logs: {count} {why}")


def downgrade() -> None:
    bind = op.get_bind()
    _refuse_if(
        bind,
        "SELECT COUNT(*) FROM audit_log WHERE nonce IS NOT NULL",
        "audit leaves carry a nonce, which the global log's verifier does not know",
    )
    _refuse_if(
        bind,
        "SELECT COUNT(*) FROM (SELECT epoch FROM epochs GROUP BY epoch HAVING COUNT(*) > 1) AS d",
        "epoch numbers are used by more than one tenant",
    )

    op.drop_table("epoch_counter")
    op.create_table(
        "epoch_counter",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute(
        "INSERT INTO epoch_counter (id, value) SELECT 1, COALESCE(MAX(epoch), 0) FROM epochs"
    )
    aside = _set_aside("epochs", ["ix_epochs_committed_at"])
    op.create_table(
        "epochs",
        sa.Column(
            "epoch",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=False,
            nullable=False,
        ),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=True),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("epoch"),
    )
    op.execute(
        "INSERT INTO epochs (epoch, committed_at, tenant_id, job_id, summary) "
        f"SELECT epoch, committed_at, tenant_id, job_id, summary FROM {aside}"
    )
    op.drop_table(aside)
    op.create_index("ix_epochs_committed_at", "epochs", ["committed_at"], unique=False)

    op.drop_table("audit_heads")
    op.drop_table("audit_nodes")
    aside = _set_aside("audit_log", ["ix_audit_log_tenant_ref"])
    _audit_log_table(
        sa.PrimaryKeyConstraint("seq"),
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=False,
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=64), nullable=True),
    )
    # One global order again: by time of logging, each tenant's leaves in their order.
    op.execute(
        "INSERT INTO audit_log (seq, tenant_id, kind, ref, payload, leaf_hash, created_at) "
        "SELECT ROW_NUMBER() OVER (ORDER BY created_at, tenant_id, seq) - 1, "
        f"tenant_id, kind, ref, payload, leaf_hash, created_at FROM {aside}"
    )
    op.drop_table(aside)
    op.create_index("ix_audit_log_ref", "audit_log", ["ref"], unique=False)
