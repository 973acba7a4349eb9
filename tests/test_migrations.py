"""The Alembic chain runs up and down on SQLite and on PostgreSQL and matches the models."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from provenance import migrate
from provenance.db import get_engine
from provenance.models import Base

TABLES = {
    "tenants", "api_keys", "sources", "source_versions", "chunks", "epochs",
    "ingestion_jobs", "receipts", "audit_log", "embeddings",
}


def check_chain(url: str) -> None:
    migrate.upgrade(url)
    engine = get_engine(url)
    assert set(inspect(engine).get_table_names()) >= TABLES
    assert migrate.current_revision(url) == migrate.head_revision(url)
    with engine.connect() as connection:
        drift = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert drift == [], f"models and migrations disagree: {drift}"
    migrate.downgrade(url, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    assert migrate.current_revision(url) is None
    migrate.upgrade(url)  # and back up again: downgrades leave nothing behind
    assert set(inspect(engine).get_table_names()) >= TABLES


def test_chain_up_and_down_on_sqlite(sqlite_url):
    check_chain(sqlite_url)


@pytest.mark.integration
def test_chain_up_and_down_on_postgresql(pg_url):
    check_chain(pg_url)
