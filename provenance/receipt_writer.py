"""Receipt commits: in groups on a committer thread, retried while the database is unreachable.

Receipts are written by one committer thread. The receipts waiting when a commit starts share
its transaction (group commit): under load, one transaction and one WAL flush serve every
answer that finished meanwhile, and no writer queues behind another for the database's write
lock. Each request is still answered only once its own receipt is committed. A group whose
commit fails for a reason other than the database being unreachable is committed again one
receipt at a time, so a receipt that cannot be written fails alone.

On SQLite a request's receipt is first tried on the event loop itself (``commit_on_loop``),
with a zero busy timeout: a local file needs no round trip, the commit takes about a
millisecond, and the loop that has just sent the answer's last token is already running, where
the committer thread must first be woken and given a core, and the loop woken again after it.
Under 16 streams on 2 cores those two waits were most of a receipt's time: p50 1.0-1.1 ms on
the loop against 2.8 through the committer (Zen 4 kind, `bench.serving --no-vllm`, two
alternations); a request alone 1.18-1.19 against 1.40-1.47 (`bench.overhead`). Should the
write lock be taken (an ingestion job, the committer), the receipt goes to the committer,
which waits for the lock as before: the loop never waits for a lock.

A commit that meets a transient failure (``provenance.db.is_transient``: the server restarting,
a dropped connection, SQLite locked past its busy timeout) is tried again with backoff until the
request's deadline. A retry first looks the receipt up, because a commit whose answer was lost
with the connection may have landed; so a receipt and its audit leaf are never written twice.
Past the deadline, or on any other failure, the write fails with ``ReceiptNotCommitted`` and
the caller fails closed: no answer is reported complete without its receipt.

The committer keeps one connection from commit to commit (``CommitterConnection``); an attempt
that fails drops it, so the next attempt connects anew.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Connection, bindparam, select

from provenance.db import get_engine, is_transient, sqlite_write_transaction
from provenance.models import Receipt
from provenance.receipts import ReceiptRecord, write_receipts

log = logging.getLogger("inherent.receipts")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class ReceiptNotCommitted(RuntimeError):
    """The receipt is not in the database: the answer it covers must not be reported complete."""


class CommitterConnection:
    """The committer's one connection: a Core connection, not a Session, whose bookkeeping cost
    0.7-1 ms a commit with the cold caches a decode leaves; kept from commit to commit and
    taken out of the pool only when there is none, since the checkout and check-in around
    every receipt cost 0.1 ms of a 1.2 ms commit (Zen 4 kind, each commit after a 300 MB
    sweep). A transaction that fails drops the connection (a database restart may have cut it),
    so the next one starts on a fresh connection, checked as the pool checks any.

    ``wait_for_lock=False`` (SQLite): a transaction whose write lock is taken fails at once
    instead of waiting out the busy timeout, and is begun and committed on the driver
    (``provenance.db.sqlite_write_transaction``); such a connection never goes back to the
    pool."""

    def __init__(self, url: str, wait_for_lock: bool = True):
        self.url, self.wait_for_lock = url, wait_for_lock
        self._connection: Connection | None = None

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One writing transaction (on SQLite, holding the write lock from BEGIN): committed on
        success, rolled back on any error."""
        if self._connection is None:
            connection = get_engine(self.url).connect().execution_options(sqlite_write=True)
            if not self.wait_for_lock:
                connection.connection.driver_connection.execute("PRAGMA busy_timeout=0")
            self._connection = connection
        try:
            if self.wait_for_lock:
                transaction = self._connection.begin()
            else:
                transaction = sqlite_write_transaction(self._connection)
            with transaction:
                yield self._connection
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                if not self.wait_for_lock:  # the pool's other users wait for the lock
                    connection.invalidate()
                connection.close()
            except Exception:  # already cut: the pool discards it
                log.debug("closing the committer's connection failed", exc_info=True)


def commit_receipts(
    database: CommitterConnection,
    records: Sequence[ReceiptRecord],
    deadline: float,
    tried_before: bool = False,
) -> int:
    """Write the receipts and their audit leaves in one transaction, retrying transient failures
    until ``deadline`` (``time.monotonic()``); return the attempts it took. ``tried_before``:
    an earlier attempt failed, so the first one looks the receipts up too."""
    attempt, delay = int(tried_before), FIRST_BACKOFF_S
    named = records[0].receipt_id if len(records) == 1 else f"{len(records)} receipts"
    while True:
        attempt += 1
        try:
            with database.transaction() as connection:
                if attempt > 1:
                    records = [r for r in records if not _committed(connection, r.receipt_id)]
                write_receipts(connection, records)
            return attempt
        except Exception as error:
            if not is_transient(error):
                raise ReceiptNotCommitted(
                    f"{named} not committed: {type(error).__name__}: {error}"
                ) from error
            if time.monotonic() + delay > deadline:
                raise ReceiptNotCommitted(
                    f"{named} not committed: the database stayed unavailable through "
                    f"{attempt} attempts ({type(error).__name__})"
                ) from error
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


def _committed(connection: Connection, receipt_id: str) -> bool:
    """A retry's lookup: an attempt whose answer was lost with its connection may have landed."""
    return connection.scalar(_FIND, {"id": receipt_id}) is not None


_FIND = select(Receipt.id).where(Receipt.id == bindparam("id"))


@dataclass(slots=True)
class _Pending:
    record: ReceiptRecord
    deadline: float
    tried_before: bool = False  # on the event loop, which found the write lock taken
    future: Future[int] = field(default_factory=Future)


class ReceiptWriter:
    """Commits receipts in groups on its own thread; ``close`` waits for the ones pending.
    ``commit_on_loop`` (default: on SQLite) lets ``write`` commit on the calling thread when
    the write lock is free."""

    def __init__(
        self, url: str, timeout_s: float, max_group: int = 64, commit_on_loop: bool | None = None
    ):
        self.url, self.timeout_s, self.max_group = url, timeout_s, max_group
        self._database = CommitterConnection(url)  # used on the committer thread only
        if commit_on_loop is None:
            commit_on_loop = url.startswith("sqlite")
        # Its lock: two loops (threads) never share the connection; the second goes on.
        self._on_loop = CommitterConnection(url, wait_for_lock=False) if commit_on_loop else None
        self._on_loop_lock = threading.Lock()
        self._pending: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        # Started by the first receipt: a process that forks after building the writer (a
        # server's workers) gets a committer in the process that writes.
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def submit(self, record: ReceiptRecord, tried_before: bool = False) -> Future[int]:
        """Queue the receipt for the next group commit; a failure is logged even if nobody waits
        for it (a cancelled request's receipt is written after its client has gone)."""
        pending = _Pending(record, time.monotonic() + self.timeout_s, tried_before)
        pending.future.add_done_callback(_log_failure)
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="inherent-receipts", daemon=True
                )
                self._thread.start()
        self._pending.put(pending)
        return pending.future

    async def write(self, record: ReceiptRecord) -> None:
        """Commit the receipt, never waiting on the loop for a lock; ReceiptNotCommitted when it
        cannot be. Shielded: a request cancelled while its receipt is being written still
        writes it."""
        tried = self._on_loop is not None and self._on_loop_lock.acquire(blocking=False)
        if tried:
            try:
                commit_receipts(self._on_loop, [record], deadline=0.0)  # one attempt
                return
            except ReceiptNotCommitted as error:
                if not _unreachable(error):
                    raise
            finally:
                self._on_loop_lock.release()
        await asyncio.shield(asyncio.wrap_future(self.submit(record, tried_before=tried)))

    def close(self) -> None:
        if self._on_loop is not None:
            with self._on_loop_lock:
                self._on_loop.close()
        with self._starting:
            if self._thread is None:
                return
            self._pending.put(None)
            self._thread.join()

    def _run(self) -> None:
        try:
            while (first := self._pending.get()) is not None:
                group = [first]
                while len(group) < self.max_group:
                    try:
                        pending = self._pending.get_nowait()
                    except queue.Empty:
                        break
                    if pending is None:  # closing: commit what came before, then stop
                        self._commit(group)
                        return
                    group.append(pending)
                self._commit(group)
        finally:
            self._database.close()

    def _commit(self, group: list[_Pending]) -> None:
        try:
            attempts = commit_receipts(
                self._database,
                [p.record for p in group],
                min(p.deadline for p in group),
                tried_before=any(p.tried_before for p in group),
            )
        except ReceiptNotCommitted as error:
            if len(group) > 1 and not _unreachable(error):
                for pending in group:  # one receipt may be at fault: it alone must fail
                    self._commit([pending])
                return
            for pending in group:
                pending.future.set_exception(error)
            return
        except Exception as error:  # a bug here: fail these requests, keep the committer alive
            log.exception("receipt committer failed")
            for pending in group:
                pending.future.set_exception(ReceiptNotCommitted(f"receipt not committed: {error}"))
            return
        for pending in group:
            pending.future.set_result(attempts)


def _unreachable(error: ReceiptNotCommitted) -> bool:
    """Whether the commit failed because the database stayed unreachable past the deadline (then
    every receipt of the group fails alike, and trying each alone would only wait again)."""
    return error.__cause__ is not None and is_transient(error.__cause__)


def _log_failure(future: Future[int]) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None:
        log.error("%s", error, exc_info=error.__cause__ or error)
