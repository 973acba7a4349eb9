"""The embedded database's own upkeep: no commit pays for a WAL checkpoint."""

import sqlite3
import threading
import time

from sqlalchemy import text

from provenance.db import WalCheckpointer, get_engine, session_scope


def test_a_commit_leaves_the_wal_checkpoint_to_its_own_thread(tmp_path):
    """SQLite's default has the commit that takes the log past 1,000 pages copy it back into the
    database before returning (once a receipt commit waited 0.45 s for it). Here that commit
    returns with the pages still in the log, and the checkpointer copies them soon after."""
    path = tmp_path / "wal.db"
    url = f"sqlite:///{path}"
    with session_scope(url, write=True) as session:
        session.execute(text("CREATE TABLE blobs (data BLOB)"))
        for _ in range(20):  # 2,000 rows of 4 KiB: about 2,000 pages
            session.execute(text(
                "INSERT INTO blobs SELECT randomblob(4096) FROM (WITH RECURSIVE n(i) AS "
                "(SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100) SELECT i FROM n)"
            ))
    wal = path.with_name("wal.db-wal")
    assert path.stat().st_size < 2**20 < 8 * 2**20 < wal.stat().st_size
    deadline = time.monotonic() + 30
    while path.stat().st_size < 8 * 2**20:
        assert time.monotonic() < deadline, "the WAL was not checkpointed"
        time.sleep(0.05)
    with session_scope(url) as session:
        assert session.scalar(text("SELECT count(*) FROM blobs")) == 2000


def test_a_connection_waits_while_another_process_holds_a_new_database(tmp_path):
    """Switching a database to WAL takes an exclusive lock without SQLite's busy handler, so a
    replica that opened a new file while another held it was told 'database is locked' at once
    (test_migrations' four replicas, now and then). The switch waits as every other statement
    does."""
    path = tmp_path / "new.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    threading.Timer(0.3, holder.execute, args=("COMMIT",)).start()
    started = time.monotonic()
    with session_scope(f"sqlite:///{path}") as session:
        assert session.scalar(text("PRAGMA journal_mode")) == "wal"
    assert time.monotonic() - started >= 0.25  # it waited for the holder
    holder.close()


def test_the_checkpointer_restarts_the_emptied_log_so_no_commit_syncs_its_header(tmp_path):
    """The first write to a log that was wholly copied back starts it over: a new header (its
    checkpoint sequence number and salts change) and an fdatasync. The checkpointer does that
    write itself, so the commit after a checkpoint (between requests: every receipt) appends to
    a log already started over, and leaves its header as it found it."""
    path = tmp_path / "restart.db"
    engine = get_engine(f"sqlite:///{path}")
    WalCheckpointer.checkpoint(engine)  # the first connection: the file is in WAL mode now
    # Writes on a connection of the test's own: a commit through the engine would mark the log
    # dirty for its background checkpointer, which could restart it between the two reads below.
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("CREATE TABLE t (x)")
    writer.execute("INSERT INTO t VALUES (1)")
    WalCheckpointer.checkpoint(engine)
    header = wal_header(path)
    writer.execute("INSERT INTO t VALUES (2)")
    assert wal_header(path) == header
    assert [x for (x,) in writer.execute("SELECT x FROM t ORDER BY x")] == [1, 2]
    writer.close()


def wal_header(path) -> bytes:
    return path.with_name(path.name + "-wal").read_bytes()[:32]
