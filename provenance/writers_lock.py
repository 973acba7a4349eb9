"""The truth store's writers' lock: one ``commit`` or ``sweep`` of a tenant at a time, across
threads and processes, held without a database transaction (see ``provenance/truth.py``)."""

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text

from provenance.hashing import blake3_hex
from provenance.versions import SessionFactory

# First key of the writers' advisory locks ("trut" in ASCII); the second is the tenant's hash.
WRITERS_LOCK_CLASS = 0x74727574
_local_writer_locks: dict[str, threading.Lock] = {}
_local_writer_locks_guard = threading.Lock()


@contextmanager
def writers_lock(sessions: SessionFactory, tenant_id: str) -> Iterator[None]:
    """Admit one truth-store writer (``commit``) or ``sweep`` of a tenant at a time, across
    threads and processes, without holding a database transaction: on PostgreSQL a
    session-level advisory lock on a connection of its own, on SQLite an exclusive ``flock`` on
    a file of the tenant's beside the database (the embedded store lives on one host). Both are
    released if the process dies."""
    with sessions() as probe:
        engine = probe.get_bind()
    if engine.dialect.name == "postgresql":
        key = {"cls": WRITERS_LOCK_CLASS, "tenant": tenant_id}
        connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            connection.execute(text("SELECT pg_advisory_lock(:cls, hashtext(:tenant))"), key)
            yield
        finally:
            try:
                connection.execute(text("SELECT pg_advisory_unlock(:cls, hashtext(:tenant))"), key)
            except Exception:
                # A connection that might still hold the lock must not go back to the pool.
                connection.invalidate()
            connection.close()
        return
    database = engine.url.database
    if not database or database == ":memory:":  # one process by construction
        with _local_writer_lock(f"{engine.url}\x1f{tenant_id}"):
            yield
        return
    folder = Path(f"{database}.writers")
    folder.mkdir(exist_ok=True)
    with (folder / blake3_hex(tenant_id)[:32]).open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # one open file per holder: threads exclude too
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _local_writer_lock(key: str) -> threading.Lock:
    with _local_writer_locks_guard:
        return _local_writer_locks.setdefault(key, threading.Lock())
