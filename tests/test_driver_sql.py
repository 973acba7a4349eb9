"""Statements on the driver's cursor (the receipt path) write what Core would, and fail as Core
would: the same rows read back through the ORM, SQLAlchemy's exception classes, a dropped
PostgreSQL connection invalidated so that the next receipt commits on a fresh one."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError

from provenance import audit_log
from provenance.db import get_engine, is_transient, session_scope
from provenance.driver_sql import DriverStatement
from provenance.hashing import canonical_json
from provenance.memory import CitedChunk
from provenance.migrate import ensure_schema
from provenance.models import AuditHead, AuditLeaf, Receipt, ReceiptCitation, ReceiptRow
from provenance.receipt_writer import CommitterConnection, commit_receipts
from provenance.receipts import ReceiptRecord, new_receipt_id
from provenance.truth import ensure_tenant

HEAD = AuditHead.__table__
RECEIPTS = Receipt.__table__


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'driver.db'}" if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    ensure_schema(url)
    with session_scope(url, write=True) as session:
        ensure_tenant(session, "acme")
    return url


def receipt_row(receipt_id: str, created_at: datetime) -> dict:
    return {
        "id": receipt_id, "tenant_id": "acme", "api_key_id": None, "created_at": created_at,
        "status": "ok", "snapshot_epoch": 2**40, "model_id": "m", "weights_hash": "w" * 64,
        "prompt_hash": "p" * 64, "output_hash": "o" * 64,
        "body": {"nested": {"list": [1, 2.5, None, "é"]}, "flag": True},
    }


@contextmanager
def committer(url: str) -> Iterator[CommitterConnection]:
    """The receipt committer's connection, closed when the test is done with it."""
    database = CommitterConnection(url)
    try:
        yield database
    finally:
        database.close()


def test_rows_written_on_the_driver_read_back_as_rows_written_by_core(url):
    """Same JSON, same instant (SQLite keeps DateTime as UTC text; PostgreSQL as timestamptz),
    whichever way the row went in."""
    at = datetime(2026, 12, 3, 6, 30, 15, 123456, tzinfo=UTC)
    with committer(url) as database, database.transaction() as connection:
        DriverStatement(insert(RECEIPTS)).execute(connection, receipt_row("rcpt_driver", at))
        connection.execute(insert(RECEIPTS), receipt_row("rcpt_core", at))
    with session_scope(url) as session:
        driver, core = (session.get(Receipt, i) for i in ["rcpt_driver", "rcpt_core"])
        for column in RECEIPTS.columns:
            if column.key != "id":
                assert getattr(driver, column.key) == getattr(core, column.key), column.key
        assert driver.body == receipt_row("x", at)["body"]
        assert driver.created_at.replace(tzinfo=driver.created_at.tzinfo or UTC) == at


def test_a_serialized_bind_is_stored_as_given_and_its_json_reads_back_as_the_dict(url):
    """The hot path hands a receipt's body over as its canonical JSON, the bytes its audit leaf
    hashes: stored as that text, it reads back as the dict whose canonical JSON it is, so the
    audit check recomputes the leaf's hash from the row."""
    at = datetime.now(UTC)
    body = receipt_row("x", at)["body"]
    body_json = canonical_json(body).decode()
    statement = DriverStatement(insert(RECEIPTS), serialized=("body",))
    with committer(url) as database, database.transaction() as connection:
        statement.execute(connection, {**receipt_row("rcpt_serialized", at), "body": body_json})
    with session_scope(url) as session:
        stored = session.get(Receipt, "rcpt_serialized").body
    assert stored == body
    assert canonical_json(stored).decode() == body_json


def test_returning_rows_come_back_through_the_column_types(url):
    """The head update's RETURNING gives the frontier as the JSON list it stored."""
    advance = DriverStatement(
        update(HEAD).where(HEAD.c.tenant_id == bindparam("tenant"))
        .values(size=HEAD.c.size + bindparam("advance")).returning(HEAD.c.size, HEAD.c.frontier)
    )
    with committer(url) as database, database.transaction() as connection:
        connection.execute(insert(HEAD), {"tenant_id": "acme", "size": 5, "frontier": ["ab", "cd"]})
        assert advance.execute(connection, {"tenant": "acme", "advance": 3}) == [(8, ["ab", "cd"])]
        assert advance.execute(connection, {"tenant": "nobody", "advance": 1}) == []


def test_a_select_reads_back_what_core_selects(url):
    """Rows through the columns' types where they have result processors (SQLite keeps DateTime
    and JSON as text), and as the driver gives them where they have none."""
    at = datetime(2026, 12, 3, 6, 30, 15, 123456, tzinfo=UTC)
    with committer(url) as database, database.transaction() as connection:
        for receipt_id in ["rcpt_a", "rcpt_b", "rcpt_c"]:
            connection.execute(insert(RECEIPTS), receipt_row(receipt_id, at))
    ids = [bindparam("first"), bindparam("second")]
    typed = select(RECEIPTS.c.id, RECEIPTS.c.created_at, RECEIPTS.c.body, RECEIPTS.c.snapshot_epoch)
    plain = select(RECEIPTS.c.id, RECEIPTS.c.snapshot_epoch)
    params = {"first": "rcpt_a", "second": "rcpt_c"}
    with get_engine(url).connect() as connection:
        for statement in [typed, plain]:
            statement = statement.where(RECEIPTS.c.id.in_(ids)).order_by(RECEIPTS.c.id)
            driver = DriverStatement(statement).execute(connection, params)
            assert driver == [tuple(row) for row in connection.execute(statement, params)]
            assert [row[0] for row in driver] == ["rcpt_a", "rcpt_c"]


def test_a_receipt_row_names_every_column_of_the_receipts_table():
    """The hot path inserts ``ReceiptRow``s with every parameter bound: a column added to the
    model must be added to the row too."""
    assert ReceiptRow._fields == tuple(column.key for column in RECEIPTS.columns)


def test_a_constraint_violation_is_sqlalchemys_and_not_transient(url):
    """The receipt writer retries only transient failures: a duplicate key must not look like one,
    and the transaction it happened in rolls back whole."""
    at = datetime.now(UTC)
    statement = DriverStatement(insert(RECEIPTS))
    with (
        pytest.raises(IntegrityError) as raised,
        committer(url) as database,
        database.transaction() as connection,
    ):
        statement.execute(connection, receipt_row("rcpt_once", at))
        statement.execute(connection, receipt_row("rcpt_once", at))
    assert not is_transient(raised.value)
    with session_scope(url) as session:
        assert session.get(Receipt, "rcpt_once") is None


def test_a_statement_on_a_connection_outside_a_transaction_begins_one(url):
    """As Core's execute would (autobegin): the rows are the caller's to commit or drop."""
    statement = DriverStatement(insert(RECEIPTS))
    with get_engine(url).connect() as connection:
        statement.execute(connection, receipt_row("rcpt_dropped", datetime.now(UTC)))
        assert connection.in_transaction()
        connection.rollback()
    with session_scope(url) as session:
        assert session.get(Receipt, "rcpt_dropped") is None


def test_a_dropped_postgresql_connection_is_invalidated_and_the_next_receipt_commits(request):
    """The server ends a connection mid-transaction (as a restart does): the statement on it
    raises a transient OperationalError, the connection is invalidated so the pool drops it, and
    the next receipt commits on a fresh one at its first attempt."""
    url = request.getfixturevalue("pg_url")
    ensure_schema(url)
    with session_scope(url, write=True) as session:
        ensure_tenant(session, "acme")
    engine = get_engine(url)
    with engine.connect() as connection:
        pid = connection.scalar(text("SELECT pg_backend_pid()"))
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(OperationalError) as raised:
            DriverStatement(insert(RECEIPTS)).execute(
                connection, receipt_row(new_receipt_id(), datetime.now(UTC))
            )
        assert is_transient(raised.value) and raised.value.connection_invalidated
        assert connection.invalidated
    receipt = record()
    with committer(url) as database:
        assert commit_receipts(database, [receipt], time.monotonic() + 30) == 1
    with session_scope(url) as session:
        assert session.get(Receipt, receipt.receipt_id) is not None


def test_the_committers_kept_connection_cut_by_the_server_is_replaced_at_the_next_attempt(request):
    """The committer keeps its connection between commits: the server ends it in between (as a
    restart does), the next commit's first attempt meets a transient error, and its second commits
    on a fresh connection."""
    url = request.getfixturevalue("pg_url")
    ensure_schema(url)
    with session_scope(url, write=True) as session:
        ensure_tenant(session, "acme")
    with committer(url) as database:
        first, second = record(), record()
        assert commit_receipts(database, [first], time.monotonic() + 30) == 1
        with database.transaction() as connection:
            pid = connection.scalar(text("SELECT pg_backend_pid()"))
        with get_engine(url).connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        assert commit_receipts(database, [second], time.monotonic() + 30) == 2
        with database.transaction() as connection:
            assert connection.scalar(text("SELECT pg_backend_pid()")) != pid
    with session_scope(url) as session:
        assert all(session.get(Receipt, r.receipt_id) is not None for r in [first, second])


def test_a_failed_transaction_drops_the_committers_connection(url):
    """Nothing of a failed transaction carries over: the next one runs on another connection
    and commits."""
    with committer(url) as database:
        statement = DriverStatement(insert(RECEIPTS))
        at = datetime.now(UTC)
        with pytest.raises(IntegrityError), database.transaction() as connection:
            failed_on = connection
            statement.execute(connection, receipt_row("rcpt_twice", at))
            statement.execute(connection, receipt_row("rcpt_twice", at))
        assert failed_on.closed
        with database.transaction() as connection:
            assert connection is not failed_on
            statement.execute(connection, receipt_row("rcpt_twice", at))
    with session_scope(url) as session:
        assert session.get(Receipt, "rcpt_twice") is not None


def test_a_group_of_two_tenants_receipts_commits_whole_with_their_citations_and_leaves(url):
    """One transaction for the group: every receipt, each cited version once per receipt, and
    each tenant's leaves in the group's order; the logs verify."""
    with session_scope(url, write=True) as session:
        ensure_tenant(session, "beta")
    cited = [("a.md", 1), ("b.md", 2), ("a.md", 1)]
    group = [record(tenant, cited) for tenant in ["acme", "beta", "acme", "beta", "acme"]]
    with committer(url) as database:
        assert commit_receipts(database, group, time.monotonic() + 30) == 1
    ids = [r.receipt_id for r in group]
    with session_scope(url) as session:
        for tenant in ["acme", "beta"]:
            logged = session.scalars(
                select(AuditLeaf.ref).where(AuditLeaf.tenant_id == tenant, AuditLeaf.ref.in_(ids))
                .order_by(AuditLeaf.seq)
            ).all()
            assert logged == [r.receipt_id for r in group if r.tenant_id == tenant]
        citations = session.execute(
            select(ReceiptCitation.receipt_id, ReceiptCitation.source_id, ReceiptCitation.version)
            .where(ReceiptCitation.receipt_id.in_(ids))
        ).all()
        assert sorted(citations) == sorted((i, s, v) for i in ids for s, v in [("a.md", 1), ("b.md", 2)])
        report = audit_log.verify(session)
    assert report.ok, report.problems


def record(tenant: str = "acme", cited: list[tuple[str, int]] = ()) -> ReceiptRecord:
    chunks = [
        CitedChunk(rank=i + 1, score=0.5, chunk_id=f"c{i}", chunk_hash="h", source_id=source,
                   version=version, ordinal=0, title=source, char_start=0, char_end=1)
        for i, (source, version) in enumerate(cited)
    ]
    return ReceiptRecord(
        receipt_id=new_receipt_id(), tenant_id=tenant, api_key_id=None, model_id="m",
        weights_hash="w" * 64, messages=[{"role": "user", "content": "hi"}], sampling={},
        engine={}, prompt_text="hi", prompt_token_count=1, template_version="t",
        retrieval={"query": "q", "snapshot_epoch": 1, "embedding_model": "e", "chunks": chunks}
        if chunks else None,
        created_at=datetime.now(timezone(timedelta(hours=5))),
    )
