"""Shared fixtures: databases (a fresh SQLite file, or a fresh PostgreSQL database when CI
provides one) and the environment switches for integration tests."""

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

PG_URL = os.environ.get("INHERENT_TEST_PG_URL", "")
REDIS_URL = os.environ.get("INHERENT_TEST_REDIS_URL", "")

requires_pg = pytest.mark.skipif(not PG_URL, reason="INHERENT_TEST_PG_URL is not set: no PostgreSQL for integration tests")
requires_redis = pytest.mark.skipif(not REDIS_URL, reason="INHERENT_TEST_REDIS_URL is not set: no Redis for integration tests")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'inherent.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A throwaway PostgreSQL database on the CI server, dropped afterwards."""
    if not PG_URL:
        pytest.skip("INHERENT_TEST_PG_URL is not set: no PostgreSQL for integration tests")
    name = f"inherent_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        from provenance.db import get_engine

        # Close pooled connections so the database can be dropped.
        get_engine.cache_clear()
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
