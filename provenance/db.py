"""Database engine and sessions for the configured URL (SQLite embedded, PostgreSQL in production)."""

import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")

# How long a SQLite statement waits for a lock another connection holds.
BUSY_TIMEOUT_S = 30


def is_transient(error: BaseException) -> bool:
    """A database failure that a later attempt may not meet: the server is down or restarting,
    the connection dropped, or SQLite stayed locked past its busy timeout. Constraint and data
    errors are not: retrying them fails the same way."""
    if isinstance(error, OperationalError | InterfaceError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


def _sqlite_on_connect(dbapi_connection, _record) -> None:
    # Transactions are begun by us (see _sqlite_on_begin), not by the driver's implicit BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")
    # WAL lets the API read while an ingestion job writes; foreign keys are off by default in SQLite.
    _switch_to_wal(cursor)
    # In WAL mode NORMAL survives an application crash; only an OS crash can drop the last
    # commits. Production durability comes from PostgreSQL.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    # No commit checkpoints the WAL itself: see WalCheckpointer.
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.close()


def _switch_to_wal(cursor) -> None:
    """PRAGMA journal_mode=WAL, waiting up to the busy timeout for a lock another process holds:
    the switch takes an exclusive lock without SQLite's busy handler, so a replica that opened a
    new database while another wrote it was told 'database is locked' at once."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def _sqlite_on_begin(connection) -> None:
    sqlite = connection.connection.driver_connection
    if sqlite.in_transaction:  # begun on the driver (sqlite_write_transaction): Core joins it
        return
    # A writer that reads before it writes must hold the write lock from the start, or WAL mode
    # fails its upgrade with SQLITE_BUSY instead of waiting (busy_timeout does not apply).
    mode = "IMMEDIATE" if connection.get_execution_options().get("sqlite_write") else "DEFERRED"
    # On the driver's connection: Core's execution path cost 0.08 ms of a receipt's 1.2 ms
    # commit with cold caches (provenance/driver_sql.py).
    _on_sqlite(sqlite, f"BEGIN {mode}")


def _on_sqlite(sqlite: sqlite3.Connection, statement: str) -> None:
    """Run the statement on the driver, its error raised as Core's would be (``is_transient``
    reads it)."""
    try:
        sqlite.execute(statement)
    except sqlite3.Error as error:
        raise DBAPIError.instance(statement, (), error, sqlite3.Error) from error


@contextmanager
def sqlite_write_transaction(connection: Connection) -> Iterator[Connection]:
    """A writing transaction on a SQLite connection, begun and committed on the driver: Core's
    transaction around a receipt's statements cost 0.16 ms with the cold caches a decode leaves,
    the driver's 0.06 (Zen 4 kind, after a 320 MB sweep). Statements run on the driver's cursor
    (provenance/driver_sql.py); a Core statement inside joins the transaction, and Core's
    bookkeeping of it ends with it. The engine's commit listeners (WalCheckpointer) are told."""
    sqlite = connection.connection.driver_connection
    _on_sqlite(sqlite, "BEGIN IMMEDIATE")
    try:
        yield connection
        _on_sqlite(sqlite, "COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):  # the error to report is the one that got us here
            sqlite.rollback()
        raise
    finally:
        if connection.in_transaction():  # what a Core statement began: the driver ended it
            connection.rollback()
    connection.dispatch.commit(connection)


class WalCheckpointer:
    """Copies SQLite's write-ahead log back into the database on a thread of its own.

    By default the commit that takes the log past 1,000 pages runs the checkpoint before it
    returns: during an ingestion that was a receipt commit now and then, held up to 0.45 s
    (bench.overhead). Here a commit only marks the log dirty; every ``interval_s`` this thread
    looks, and runs a PASSIVE checkpoint of a dirty log, which waits for no reader or writer.
    Other processes on the same file run their own; SQLite's locks keep them apart.

    The mark is a plain flag this thread polls, not an event that wakes it: between requests
    every receipt's commit was the first since a checkpoint, and waking this thread from it took
    0.07 ms of the commit (a thread woken on the other core; Xeon, family 6 model 167).
    """

    def __init__(self, engine: Engine, interval_s: float = 0.5):
        self._engine = weakref.ref(engine)  # the thread ends once the engine is dropped
        self._interval_s = interval_s
        self._dirty = False  # a commit since the last checkpoint
        event.listen(engine, "commit", self._mark_dirty)
        threading.Thread(target=self._run, name="inherent-wal-checkpoint", daemon=True).start()

    def _mark_dirty(self, _connection: object) -> None:
        self._dirty = True

    def _run(self) -> None:
        while True:
            time.sleep(self._interval_s)  # one checkpoint for the commits of the interval
            engine = self._engine()
            if engine is None:
                return
            if self._dirty:
                self._dirty = False  # before it runs: a commit meanwhile is seen next time
                self.checkpoint(engine)
            del engine

    @staticmethod
    def checkpoint(engine: Engine) -> None:
        connection = engine.raw_connection()
        try:
            sqlite = connection.driver_connection
            busy, frames, copied = sqlite.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if not busy and frames == copied:
                _restart_wal(sqlite)
        except Exception:  # a locked or closing database: the next interval tries again
            pass
        finally:
            connection.close()


def _restart_wal(sqlite: sqlite3.Connection) -> None:
    """Start the emptied log over from its first frame here, not in the next commit: the first
    write to a log that was wholly copied back writes a new log header and syncs it, and between
    requests that was every receipt's commit (a 0.5 ms fdatasync of its 2.7, Zen 4 kind). The
    write sets user_version to its own value. A writer holding the lock restarts the log itself,
    so this does not wait for one."""
    sqlite.execute("PRAGMA busy_timeout=0")
    try:
        sqlite.execute("BEGIN IMMEDIATE")
        try:
            (version,) = sqlite.execute("PRAGMA user_version").fetchone()
            sqlite.execute(f"PRAGMA user_version={int(version)}")
            sqlite.execute("COMMIT")
        except BaseException:
            sqlite.execute("ROLLBACK")
            raise
    finally:
        sqlite.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_S * 1000}")


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        WalCheckpointer(engine)
        return engine
    # Pinned rather than left to the server's default_transaction_isolation: the row locks that
    # serialize epoch and audit-log writers rely on a waiter re-reading the row its predecessor
    # committed, which REPEATABLE READ and SERIALIZABLE answer with a serialization failure.
    # pre-ping: a pooled connection that a database restart cut is replaced before it is used.
    return create_engine(url, pool_pre_ping=True, isolation_level="READ COMMITTED")


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str, write: bool = False) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any error, always close.

    ``write=True`` marks a transaction that will write: on SQLite it takes the write lock at
    BEGIN so concurrent writers queue instead of failing.
    """
    session = get_sessionmaker(url)()
    if write:
        session.connection(execution_options={"sqlite_write": True})
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def insert_missing(
    session: Session | Connection, model: type, rows: Sequence[dict[str, Any]]
) -> None:
    """INSERT rows, skipping those whose primary key already exists (ON CONFLICT DO NOTHING)."""
    if not rows:
        return
    bind = session.get_bind() if isinstance(session, Session) else session
    dialect = bind.dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported databases
        raise RuntimeError(f"unsupported database dialect {dialect!r}")
    session.execute(insert(model).on_conflict_do_nothing(), list(rows))


def in_batches(values: Iterable[T], size: int = 500) -> Iterator[list[T]]:
    """``values`` in consecutive lists of at most ``size``: one ``IN (...)`` each, so a long
    list of ids never exceeds a database's bound-parameter limit."""
    values = list(values)
    for start in range(0, len(values), size):
        yield values[start : start + size]
