"""Group commit of receipts (provenance/receipt_writer.py): the receipts waiting when a commit
starts share its transaction, each is answered only once committed, and one that cannot be
written fails alone. On SQLite the loop commits its own receipt while the write lock is free."""

import asyncio
import sqlite3
import threading

import pytest
from sqlalchemy import event, func, select

from provenance import audit_log, migrate, receipt_writer
from provenance.db import BUSY_TIMEOUT_S, get_engine, session_scope
from provenance.models import AuditLeaf, Receipt, Tenant
from provenance.receipt_writer import ReceiptNotCommitted, ReceiptWriter
from provenance.receipts import ReceiptRecord, new_receipt_id


def record(tenant: str = "acme") -> ReceiptRecord:
    return ReceiptRecord(
        receipt_id=new_receipt_id(), tenant_id=tenant, api_key_id=None, model_id="m",
        weights_hash="w", messages=[{"role": "user", "content": "q"}], sampling={}, engine={},
        retrieval=None, prompt_text="p", prompt_token_count=1, template_version="t",
        output_text="a",
    )


@pytest.fixture
def url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'receipts.db'}"
    migrate.upgrade(url)
    with session_scope(url, write=True) as session:
        session.add_all([Tenant(id="acme", name="acme"), Tenant(id="globex", name="globex")])
    return url


def stored(url: str) -> tuple[set[str], int]:
    with session_scope(url) as session:
        ids = set(session.scalars(select(Receipt.id)))
        leaves = session.scalar(select(func.count()).where(AuditLeaf.kind == "receipt"))
    return ids, leaves


@pytest.fixture
def held_transactions(monkeypatch):
    """Every transaction's receipt ids; the first transaction waits until released, so the
    receipts submitted meanwhile queue behind it. Returns the ids, the first receipt's future
    (its commit under way) and the release."""
    groups: list[list[str]] = []
    holding, release = threading.Event(), threading.Event()
    real = receipt_writer.commit_receipts

    def commit(url, records, deadline, **options):
        groups.append([r.receipt_id for r in records])
        if len(groups) == 1:
            holding.set()
            release.wait(10)
        return real(url, records, deadline, **options)

    monkeypatch.setattr(receipt_writer, "commit_receipts", commit)

    def hold(writer: ReceiptWriter):
        first = writer.submit(record())
        assert holding.wait(10)
        return first

    return groups, hold, release


def test_receipts_that_finish_together_share_one_transaction(url, held_transactions):
    groups, hold, release = held_transactions
    writer = ReceiptWriter(url, timeout_s=10)
    first = hold(writer)
    together = [record(tenant) for tenant in ["acme", "globex"] * 8]
    futures = [writer.submit(r) for r in together]
    release.set()
    assert first.result(10) == 1 and all(f.result(10) == 1 for f in futures)
    writer.close()
    assert groups == [[groups[0][0]], [r.receipt_id for r in together]]
    ids, leaves = stored(url)
    assert ids == {groups[0][0], *(r.receipt_id for r in together)} and leaves == 17
    # Each tenant's leaves in the order its receipts were submitted, and the logs verify.
    with session_scope(url) as session:
        for tenant in ["acme", "globex"]:
            logged = session.scalars(
                select(AuditLeaf.ref).where(AuditLeaf.tenant_id == tenant).order_by(AuditLeaf.seq)
            ).all()
            submitted = [r.receipt_id for r in together if r.tenant_id == tenant]
            assert logged == ([groups[0][0]] if tenant == "acme" else []) + submitted
        report = audit_log.verify(session)
    assert report.ok, report.problems
    assert {t: size for t, (size, _) in report.trees.items()} == {"acme": 9, "globex": 8}


def test_a_receipt_that_cannot_be_written_fails_alone(url, held_transactions):
    groups, hold, release = held_transactions
    bad = record(tenant="no-such-tenant")  # no such tenant: its rows break a foreign key
    writer = ReceiptWriter(url, timeout_s=10)
    first = hold(writer)
    good = [record(), record()]
    futures = {r.receipt_id: writer.submit(r) for r in [good[0], bad, good[1]]}
    release.set()
    first.result(10)
    with pytest.raises(ReceiptNotCommitted, match=bad.receipt_id):
        futures[bad.receipt_id].result(10)
    assert all(futures[r.receipt_id].result(10) == 1 for r in good)
    writer.close()
    # the group failed as one transaction, then each receipt was committed alone
    assert groups[1] == [good[0].receipt_id, bad.receipt_id, good[1].receipt_id]
    assert groups[2:] == [[good[0].receipt_id], [bad.receipt_id], [good[1].receipt_id]]
    ids, leaves = stored(url)
    assert ids == {groups[0][0], *(r.receipt_id for r in good)}
    assert leaves == 3


def test_close_waits_for_every_pending_receipt(url):
    writer = ReceiptWriter(url, timeout_s=10)
    records = [record() for _ in range(40)]
    futures = [writer.submit(r) for r in records]
    writer.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert stored(url) == ({r.receipt_id for r in records}, 40)


def test_write_returns_once_committed_and_raises_when_not(url, monkeypatch):
    writer = ReceiptWriter(url, timeout_s=10)
    written = record()
    asyncio.run(writer.write(written))
    assert written.receipt_id in stored(url)[0]

    def refuse(url, records, deadline, **options):
        raise ReceiptNotCommitted("refused")

    monkeypatch.setattr(receipt_writer, "commit_receipts", refuse)
    with pytest.raises(ReceiptNotCommitted, match="refused"):
        asyncio.run(writer.write(record()))
    writer.close()


def test_a_cancelled_request_still_writes_its_receipt(url, held_transactions):
    _, hold, release = held_transactions
    writer = ReceiptWriter(url, timeout_s=10, commit_on_loop=False)
    hold(writer)
    late = record()

    async def cancel_while_writing():
        task = asyncio.create_task(writer.write(late))
        await asyncio.sleep(0.05)  # queued behind the held commit
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_writing())  # the loop is gone before the commit settles
    release.set()
    writer.close()
    assert late.receipt_id in stored(url)[0]


@pytest.fixture
def commit_threads(monkeypatch) -> list[str]:
    """The thread each commit attempt ran on, in order."""
    threads: list[str] = []
    real = receipt_writer.commit_receipts

    def commit(database, records, deadline, **options):
        threads.append(threading.current_thread().name)
        return real(database, records, deadline, **options)

    monkeypatch.setattr(receipt_writer, "commit_receipts", commit)
    return threads


def test_on_sqlite_the_loop_commits_its_receipt_itself(url, commit_threads):
    writer = ReceiptWriter(url, timeout_s=10)
    commits = []  # the engine's commit listeners: the WAL checkpointer's among them
    event.listen(get_engine(url), "commit", commits.append)
    written = [record(), record("globex"), record(), record("globex")]  # first leaves, then not
    for r in written:
        asyncio.run(writer.write(r))
    writer.close()
    assert len(commits) == 4
    assert commit_threads == [threading.current_thread().name] * 4  # no committer thread
    assert stored(url) == ({r.receipt_id for r in written}, 4)
    with session_scope(url) as session:
        assert audit_log.verify(session).ok


def test_a_receipt_that_finds_the_write_lock_taken_waits_on_the_committer(url, commit_threads):
    writer = ReceiptWriter(url, timeout_s=10)
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # an ingestion job's transaction, say
    late = record()
    done = threading.Event()
    writing = threading.Thread(
        target=lambda: (asyncio.run(writer.write(late)), done.set()), name="loop"
    )
    writing.start()
    assert not done.wait(0.3)  # the loop went on; the committer waits for the lock
    holder.rollback()
    writing.join(10)
    writer.close()
    assert done.is_set()
    assert commit_threads == ["loop", "inherent-receipts"]
    assert stored(url) == ({late.receipt_id}, 1)
    # The loop's connection, which waits for no lock, never went back to the pool.
    with session_scope(url) as session:
        assert session.connection().exec_driver_sql("PRAGMA busy_timeout").scalar() == BUSY_TIMEOUT_S * 1000


def test_a_receipt_that_cannot_be_written_on_the_loop_fails_alone(url):
    writer = ReceiptWriter(url, timeout_s=10)
    bad, good = record(tenant="no-such-tenant"), record()
    with pytest.raises(ReceiptNotCommitted, match=bad.receipt_id):
        asyncio.run(writer.write(bad))
    asyncio.run(writer.write(good))
    writer.close()
    assert stored(url) == ({good.receipt_id}, 1)


def test_on_postgresql_receipts_are_committed_by_the_committer(pg_url, commit_threads):
    migrate.upgrade(pg_url)
    with session_scope(pg_url, write=True) as session:
        session.add(Tenant(id="acme", name="acme"))
    writer = ReceiptWriter(pg_url, timeout_s=10)
    written = record()
    asyncio.run(writer.write(written))
    writer.close()
    assert commit_threads == ["inherent-receipts"]  # the loop waits on no network round trip
    assert stored(pg_url) == ({written.receipt_id}, 1)
