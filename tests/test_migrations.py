"""The Alembic chain runs up and down on SQLite and on PostgreSQL and matches the models."""

import multiprocessing
import sqlite3
from contextlib import closing, suppress
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import event, inspect

from provenance import audit_log, merkle, migrate, truth
from provenance.db import _restart_wal, get_engine, session_scope
from provenance.models import Base, EpochCounter, Receipt
from provenance.settings import Settings, get_settings

TABLES = {
    "tenants", "api_keys", "sources", "source_versions", "chunks", "epochs",
    "ingestion_jobs", "receipts", "audit_log", "audit_nodes", "audit_heads", "embeddings",
    "epoch_counter", "uploads",
}


def check_chain(url: str) -> None:
    migrate.upgrade(url)
    engine = get_engine(url)
    assert set(inspect(engine).get_table_names()) >= TABLES
    assert migrate.current_revision(url) == migrate.head_revision(url)
    with engine.connect() as connection:
        drift = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert drift == [], f"models and migrations disagree: {drift}"
    migrate.downgrade(url, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    assert migrate.current_revision(url) is None
    migrate.upgrade(url)  # and back up again: downgrades leave nothing behind
    assert set(inspect(engine).get_table_names()) >= TABLES


def test_chain_up_and_down_on_sqlite(sqlite_url):
    check_chain(sqlite_url)


@pytest.mark.integration
def test_chain_up_and_down_on_postgresql(pg_url):
    check_chain(pg_url)


# A store as revision 0002 left it: one global audit log with two tenants' receipts interleaved,
# and one global epoch sequence.
LEGACY_RECEIPTS = [("acme", "r0"), ("beta", "r1"), ("acme", "r2"), ("beta", "r3"), ("acme", "r4")]
LEGACY_EPOCHS = [(1, "acme"), (2, "beta"), (3, "acme")]


def legacy_receipt(tenant: str, receipt_id: str) -> Receipt:
    return Receipt(
        id=receipt_id, tenant_id=tenant, api_key_id=None, status="ok", snapshot_epoch=1,
        model_id="m", weights_hash="w", prompt_hash=f"p-{receipt_id}",
        output_hash=f"o-{receipt_id}", body={"receipt_id": receipt_id},
    )


def write_legacy_store(url: str) -> dict[str, list[bytes]]:
    """Fill a database at revision 0002; return each tenant's leaf hashes in logged order."""
    migrate.upgrade(url, "0002")
    table = lambda name, *cols: sa.table(name, *(sa.column(c) for c in cols))  # noqa: E731
    now = datetime.now(UTC)
    leaves: dict[str, list[bytes]] = {}
    with get_engine(url).begin() as connection:
        connection.execute(
            table("tenants", "id", "name", "created_at").insert(),
            [{"id": t, "name": t, "created_at": now} for t in ("acme", "beta")],
        )
        receipts, log = [], []
        for seq, (tenant, receipt_id) in enumerate(LEGACY_RECEIPTS):
            receipt = legacy_receipt(tenant, receipt_id)
            receipts.append(
                {c.name: getattr(receipt, c.key) for c in Receipt.__table__.columns} | {"created_at": now}
            )
            payload = audit_log.receipt_leaf_payload(receipt)
            digest = merkle.leaf_hash(audit_log.leaf_data("receipt", receipt_id, payload, None))
            leaves.setdefault(tenant, []).append(digest)
            log.append({"seq": seq, "kind": "receipt", "ref": receipt_id, "tenant_id": tenant,
                        "payload": payload, "leaf_hash": digest.hex(),
                        "created_at": now + timedelta(milliseconds=seq)})
        connection.execute(sa.insert(Receipt.__table__), receipts)
        legacy_log = sa.table("audit_log", *(sa.column(c) for c in ("seq", "kind", "ref", "tenant_id", "leaf_hash", "created_at")), sa.column("payload", sa.JSON()))
        connection.execute(legacy_log.insert(), log)
        connection.execute(
            sa.table("epochs", sa.column("epoch"), sa.column("tenant_id"), sa.column("committed_at"), sa.column("summary", sa.JSON())).insert(),
            [{"epoch": e, "tenant_id": t, "committed_at": now, "summary": {}} for e, t in LEGACY_EPOCHS],
        )
        connection.execute(sa.text("UPDATE epoch_counter SET value = 3"))
    return leaves


def check_data_migration(url: str) -> None:
    leaves = write_legacy_store(url)
    migrate.upgrade(url)
    with session_scope(url) as session:
        assert audit_log.verify(session).ok
        for tenant, hashes in leaves.items():
            # Each tenant's leaves, in their old order, now make a tree of their own.
            assert audit_log.root(session, tenant) == (len(hashes), merkle.root(hashes))
            refs = [r for t, r in LEGACY_RECEIPTS if t == tenant]
            for index, ref in enumerate(refs):
                proof = audit_log.inclusion_proof(session, tenant, ref)
                assert proof["leaf_index"] == index
                assert proof["audit_path"] == [h.hex() for h in merkle.inclusion_proof(index, hashes)]
        assert audit_log.inclusion_proof(session, "beta", "r0") is None
        # Epochs keep their numbers and belong to their tenants; each counter goes on from its own.
        assert (truth.current_epoch(session, "acme"), truth.current_epoch(session, "beta")) == (3, 2)
        assert dict(session.execute(sa.select(EpochCounter.tenant_id, EpochCounter.value)).all()) == {"acme": 3, "beta": 2}

    # Back down to one global log, in the order the leaves were logged...
    migrate.downgrade(url, "0002")
    with get_engine(url).connect() as connection:
        rows = connection.execute(sa.text("SELECT seq, ref FROM audit_log ORDER BY seq")).all()
        assert [ref for _, ref in rows] == [r for _, r in LEGACY_RECEIPTS]
        assert connection.execute(sa.text("SELECT value FROM epoch_counter")).scalar() == 3
    # ...and up again; a leaf with a nonce then pins the store to the per-tenant schema.
    migrate.upgrade(url)
    with session_scope(url, write=True) as session:
        receipt = legacy_receipt("beta", "r5")
        session.add(receipt)
        session.flush()
        assert audit_log.append_leaves(session, "beta", [audit_log.receipt_leaf(receipt)]) == [2]
    with pytest.raises(RuntimeError, match="1 audit leaves carry a nonce"):
        migrate.downgrade(url, "0002")


def test_data_migrates_to_per_tenant_logs_on_sqlite(sqlite_url):
    check_data_migration(sqlite_url)


@pytest.mark.integration
def test_data_migrates_to_per_tenant_logs_on_postgresql(pg_url):
    check_data_migration(pg_url)


def test_a_process_that_may_not_migrate_refuses_a_schema_behind_with_what_to_do(pg_url):
    settings = Settings(database_url=pg_url)  # production: migrate_on_start unset
    assert not migrate.migrates_on_start(settings)
    with pytest.raises(migrate.SchemaMismatch, match=r"base \(empty\).*inherent db upgrade"):
        migrate.ready_schema(settings)
    assert migrate.current_revision(pg_url) is None  # nothing was migrated
    migrate.ready_schema(settings.model_copy(update={"migrate_on_start": True}))
    assert migrate.current_revision(pg_url) == migrate.head_revision(pg_url)
    migrate.ready_schema(settings)  # at head: starts


def test_the_embedded_database_migrates_on_start_unless_told_not_to(tmp_path):
    settings = Settings(data_dir=tmp_path)
    migrate.ready_schema(settings)
    assert migrate.current_revision(settings.sqlalchemy_url) == migrate.head_revision(settings.sqlalchemy_url)
    other = Settings(data_dir=tmp_path / "other", migrate_on_start=False)
    other.data_dir.mkdir()
    with pytest.raises(migrate.SchemaMismatch):
        migrate.ready_schema(other)


def test_a_schema_from_a_newer_release_is_refused(sqlite_url):
    migrate.upgrade(sqlite_url)
    with get_engine(sqlite_url).begin() as connection:
        connection.exec_driver_sql("UPDATE alembic_version SET version_num = '0099_future'")
    with pytest.raises(migrate.SchemaMismatch, match=r"0099_future.*newer release"):
        migrate.check_schema(sqlite_url)


def migrate_in_a_process(url: str, start, results) -> None:
    start.wait()  # every process checks the empty schema at the same moment
    try:
        migrate.ensure_schema(url)
        results.put(migrate.current_revision(url))
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_replicas_starting_together_migrate_once_under_the_lock(backend, request):
    """Four processes told to migrate the same empty database at once: without the lock
    several of them would create the same tables and fail."""
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(4), context.Queue()
    processes = [
        context.Process(target=migrate_in_a_process, args=(url, start, results)) for _ in range(4)
    ]
    for process in processes:
        process.start()
    revisions = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert revisions == [migrate.head_revision(url)] * 4


def test_the_worker_refuses_to_start_on_a_schema_behind(pg_url, monkeypatch):
    from ingest import celery_app

    monkeypatch.setenv("INHERENT_DATABASE_URL", pg_url)
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit, match=r"inherent worker: .*inherent db upgrade"):
            celery_app._check_schema()
    finally:
        get_settings.cache_clear()


@pytest.mark.integration
def test_a_receipts_index_build_cut_short_is_replaced_by_the_rerun(pg_url):
    """CREATE INDEX CONCURRENTLY (no write waits for it) leaves an invalid index of its name
    when cut short; the migration run again drops it and builds a valid one."""
    migrate.upgrade(pg_url, "0005_uploads")
    engine = get_engine(pg_url)
    with engine.begin() as connection:  # what a cut build leaves: the name, on other terms
        connection.execute(sa.text("CREATE INDEX ix_receipts_tenant_created ON receipts (status)"))
        connection.execute(sa.text(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = 'ix_receipts_tenant_created'::regclass"
        ))
    migrate.upgrade(pg_url)
    indexes = {i["name"]: i["column_names"] for i in inspect(engine).get_indexes("receipts")}
    assert indexes == {"ix_receipts_tenant_created": ["tenant_id", "created_at", "id"]}
    with engine.connect() as connection:
        assert connection.scalar(sa.text(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'ix_receipts_tenant_created'::regclass"
        ))


def test_a_migration_on_sqlite_is_not_failed_by_the_wal_restart_of_the_checkpointer(tmp_path):
    """The engine's WAL checkpointer writes (it restarts the emptied log) whenever it finds the
    log copied back, which a migration's commits make it do mid-chain. SQLite fails, at once, a
    transaction that read and then writes once another connection committed meanwhile
    ("database is locked"): a migration takes the write lock as it begins, so the restart waits
    its turn instead (it gives up and tries again later)."""
    path = tmp_path / "inherent.db"
    url = f"sqlite:///{path}"
    migrate.upgrade(url, "0005_uploads")
    engine = get_engine(url)

    def restart_the_log(connection, cursor, statement, *args) -> None:
        if statement.startswith("CREATE INDEX ix_receipts_tenant_created"):
            with closing(sqlite3.connect(path)) as other, suppress(sqlite3.OperationalError):
                _restart_wal(other)  # what WalCheckpointer runs on its own thread

    event.listen(engine, "before_cursor_execute", restart_the_log)
    try:
        migrate.upgrade(url)
    finally:
        event.remove(engine, "before_cursor_execute", restart_the_log)
    assert migrate.current_revision(url) == migrate.head_revision(url)
