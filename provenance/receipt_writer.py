"""Receipt commits off the event loop, retried while the database is unreachable.

A request's receipt is written by a small pool of threads, never on the asyncio loop. A commit
that meets a transient failure (``provenance.db.is_transient``: the server restarting, a
dropped connection, SQLite locked past its busy timeout) is tried again with backoff until the
request's deadline. A retry first looks the receipt up, because a commit whose answer was lost
with the connection may have landed; so a receipt and its audit leaf are never written twice.
Past the deadline, or on any other failure, the write fails with ``ReceiptNotCommitted`` and
the caller fails closed: no answer is reported complete without its receipt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from provenance.db import is_transient, session_scope
from provenance.models import Receipt
from provenance.receipts import ReceiptRecord, write_receipt

log = logging.getLogger("inherent.receipts")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class ReceiptNotCommitted(RuntimeError):
    """The receipt is not in the database: the answer it covers must not be reported complete."""


def commit_receipt(url: str, record: ReceiptRecord, deadline: float) -> int:
    """Write the receipt and its audit leaf in one transaction, retrying transient failures until
    ``deadline`` (``time.monotonic()``); return the attempts it took."""
    attempt, delay = 0, FIRST_BACKOFF_S
    while True:
        attempt += 1
        try:
            with session_scope(url, write=True) as session:
                if attempt == 1 or session.get(Receipt, record.receipt_id) is None:
                    write_receipt(session, record)
            return attempt
        except Exception as error:
            if not is_transient(error):
                raise ReceiptNotCommitted(
                    f"receipt {record.receipt_id} was not committed: {type(error).__name__}: {error}"
                ) from error
            if time.monotonic() + delay > deadline:
                raise ReceiptNotCommitted(
                    f"receipt {record.receipt_id} was not committed: the database stayed "
                    f"unavailable through {attempt} attempts ({type(error).__name__})"
                ) from error
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


class ReceiptWriter:
    """Commits receipts on its own threads; ``close`` waits for the ones still pending."""

    def __init__(self, url: str, timeout_s: float, workers: int = 4):
        self.url, self.timeout_s = url, timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="inherent-receipts")

    def submit(self, record: ReceiptRecord) -> Future[int]:
        """Start committing the receipt; a failure is logged even if nobody waits for it (a
        cancelled request's receipt is written after its client has gone)."""
        deadline = time.monotonic() + self.timeout_s
        future = self._pool.submit(commit_receipt, self.url, record, deadline)
        future.add_done_callback(_log_failure)
        return future

    async def write(self, record: ReceiptRecord) -> None:
        """Commit the receipt without blocking the loop; ReceiptNotCommitted when it cannot be.
        Shielded: a request cancelled while its receipt is being written still writes it."""
        await asyncio.shield(asyncio.wrap_future(self.submit(record)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _log_failure(future: Future[int]) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None:
        log.error("%s", error, exc_info=error.__cause__ or error)
