"""Alembic environment: the URL comes from the caller (``inherent db``) or from Settings."""

from alembic import context
from sqlalchemy import pool

from provenance.db import get_engine
from provenance.models import Base
from provenance.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().sqlalchemy_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = get_engine(url) if url.startswith("sqlite") else None
    if connectable is None:
        from sqlalchemy import create_engine

        connectable = create_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        # A migration reads, then writes: on SQLite it takes the write lock as it begins, or a
        # commit by another connection in between (the WAL checkpointer's) fails its first write
        # at once with "database is locked" (provenance.db's begin listener; ignored elsewhere).
        connection = connection.execution_options(sqlite_write=True)
        # Batch mode lets ALTER-style migrations run on SQLite too.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
