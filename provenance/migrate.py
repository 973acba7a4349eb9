"""Run the Alembic chain in ``migrations/`` against a URL, from code (CLI, tests, app start).

In production the schema is migrated once, by ``inherent db upgrade`` in its own job (a compose
service, a Kubernetes Job); API and worker processes only check that the database is at the
revision they were built for (``ready_schema``) and refuse to start otherwise. Told to migrate
(``INHERENT_MIGRATE_ON_START``, the default for the embedded SQLite file, which one process
owns), they migrate under a database lock so that replicas starting together, or a replica
racing the migration job, apply each revision once.
"""

import fcntl
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from provenance.db import get_engine
from provenance.settings import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"
# The PostgreSQL advisory lock every migrating process takes: one 64-bit key for this project.
ADVISORY_LOCK_KEY = zlib.crc32(b"inherent schema migrations")
LOCK = text("SELECT pg_try_advisory_lock(:key)")
UNLOCK = text("SELECT pg_advisory_unlock(:key)")
LOCK_POLL_S = 0.2


class SchemaMismatch(RuntimeError):
    """The database is not at the revision this release expects, and this process may not
    migrate it."""


def alembic_config(url: str) -> Config:
    if not MIGRATIONS_DIR.is_dir():
        raise RuntimeError(
            f"migrations folder not found at {MIGRATIONS_DIR}; install Inherent from its source tree "
            "(pip install -e .) so the Alembic chain ships with it"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would choke on '%' in passwords.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


@contextmanager
def schema_lock(url: str) -> Iterator[None]:
    """Hold the migration lock: a session-level advisory lock on PostgreSQL, an exclusive
    ``flock`` on a file beside the SQLite database. Waits while another process holds it.

    On PostgreSQL the lock is tried, not waited for in a statement: a statement blocked on it
    holds a snapshot, and CREATE INDEX CONCURRENTLY (a migration's) waits for every older
    snapshot to end, so the migrating process would wait on its waiters while they wait on it."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        with get_engine(url).connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT")
            while not connection.scalar(LOCK, {"key": ADVISORY_LOCK_KEY}):
                time.sleep(LOCK_POLL_S)
            try:
                yield
            finally:
                connection.execute(UNLOCK, {"key": ADVISORY_LOCK_KEY})
        return
    database = parsed.database
    if not database or database == ":memory:":
        yield  # a private in-memory database: nobody to race
        return
    with open(f"{database}.migrate.lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def upgrade(url: str, revision: str = "head") -> None:
    with schema_lock(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    with schema_lock(url):
        command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    engine = get_engine(url)
    if "alembic_version" not in inspect(engine).get_table_names():
        return None
    with engine.connect() as connection:
        return connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def ensure_schema(url: str) -> None:
    """Bring a database to head under the migration lock; a no-op when it is already there."""
    if current_revision(url) != head_revision(url):
        upgrade(url)  # alembic re-reads the revision under the lock: a racer's work is not redone


def check_schema(url: str) -> None:
    """Raise SchemaMismatch, saying what to do, unless the database is at this release's head."""
    current, head = current_revision(url), head_revision(url)
    if current == head:
        return
    where = make_url(url).render_as_string(hide_password=True)
    known = {script.revision for script in ScriptDirectory.from_config(alembic_config(url)).walk_revisions()}
    if current is not None and current not in known:
        raise SchemaMismatch(
            f"the database {where} is at revision {current}, which this release does not know "
            f"(its head is {head}): a newer release migrated it; run that release"
        )
    raise SchemaMismatch(
        f"the database {where} is at revision {current or 'base (empty)'}, behind this release's "
        f"{head}: run the migrations once ('inherent db upgrade', the migrate service or Job), "
        "or set INHERENT_MIGRATE_ON_START=true to migrate here under a database lock"
    )


def migrates_on_start(settings: Settings) -> bool:
    """Whether a starting process migrates: as set, else only on the embedded SQLite file."""
    if settings.migrate_on_start is not None:
        return settings.migrate_on_start
    return not settings.database_url


def prepare_schema(url: str, migrate: bool) -> None:
    """Migrate (under the lock) when ``migrate``, otherwise refuse (SchemaMismatch) a database
    whose schema is not this release's."""
    if migrate:
        ensure_schema(url)
    else:
        check_schema(url)


def ready_schema(settings: Settings) -> None:
    """What an API or worker process does at start (see ``migrates_on_start``)."""
    prepare_schema(settings.sqlalchemy_url, migrates_on_start(settings))
