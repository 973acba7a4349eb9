"""Finding receipts: by id, time range, status and cited source version, a page at a time, on
SQLite and on PostgreSQL; and the incident bundle that ``inherent audit verify-bundle`` checks."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, text, update
from typer.testing import CliRunner

from gateway.cli import app
from provenance import audit_log, incident, migrate
from provenance.db import session_scope
from provenance.memory import CitedChunk
from provenance.models import Receipt, Tenant
from provenance.receipts import ReceiptQuery, ReceiptRecord, list_receipts, write_receipts

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)

# (id, minutes after T0, error type or None, cited (source, version) pairs, tenant)
ROWS = [
    ("r0", 0, None, [("pricing.md", 3)], "acme"),
    ("r1", 1, None, [("pricing.md", 2), ("faq.md", 1)], "acme"),
    ("r2", 2, "RuntimeError", [("pricing.md", 3)], "acme"),
    ("r3", 3, "cancelled", [], "acme"),
    ("r4", 4, None, [("pricing.md", 3), ("pricing.md", 3)], "acme"),
    ("r5", 5, None, [("pricing.md", 3)], "globex"),
]


def record(receipt_id, minutes, error, cited, tenant) -> ReceiptRecord:
    chunks = [
        CitedChunk(rank=i + 1, score=0.5, chunk_id=f"{receipt_id}-c{i}", chunk_hash="h",
                   source_id=s, version=v, ordinal=0, title=s, char_start=0, char_end=1)
        for i, (s, v) in enumerate(cited)
    ]
    return ReceiptRecord(
        receipt_id=receipt_id, tenant_id=tenant, api_key_id=None, model_id="m",
        weights_hash="w", messages=[{"role": "user", "content": f"question {receipt_id}"}],
        sampling={"temperature": 0.0}, engine={}, prompt_text="p", prompt_token_count=1,
        template_version="t", created_at=T0 + timedelta(minutes=minutes),
        retrieval={"query": "q", "snapshot_epoch": 1, "embedding_model": "e", "chunks": chunks},
        output_text=f"answer {receipt_id}",
        error={"type": error, "message": error} if error else None,
    )


def seed(url: str) -> str:
    migrate.upgrade(url)
    with session_scope(url, write=True) as session:
        session.add_all([Tenant(id="acme", name="acme"), Tenant(id="globex", name="globex")])
        session.flush()
        for row in ROWS:
            write_receipts(session, [record(*row)])
    return url


def ids(url: str, query: ReceiptQuery, limit: int = 100, after=None, tenant="acme") -> list[str]:
    with session_scope(url) as session:
        return [r.id for r in list_receipts(session, tenant, query, limit, after)]


def check_filters(url: str) -> None:
    assert ids(url, ReceiptQuery()) == ["r0", "r1", "r2", "r3", "r4"]
    assert ids(url, ReceiptQuery(newest_first=True)) == ["r4", "r3", "r2", "r1", "r0"]
    assert ids(url, ReceiptQuery(receipt_id="r2")) == ["r2"]
    assert ids(url, ReceiptQuery(receipt_id="r5")) == []  # another tenant's
    assert ids(url, ReceiptQuery(status="ok")) == ["r0", "r1", "r4"]
    assert ids(url, ReceiptQuery(status="failed")) == ["r2"]
    assert ids(url, ReceiptQuery(status="cancelled")) == ["r3"]
    assert ids(url, ReceiptQuery(source_id="pricing.md")) == ["r0", "r1", "r2", "r4"]
    assert ids(url, ReceiptQuery(source_id="pricing.md", version=3)) == ["r0", "r2", "r4"]
    assert ids(url, ReceiptQuery(source_id="pricing.md", version=3, status="ok")) == ["r0", "r4"]
    assert ids(url, ReceiptQuery(source_id="faq.md")) == ["r1"]
    window = ReceiptQuery(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3))
    assert ids(url, window) == ["r1", "r2"]  # since inclusive, until exclusive
    assert ids(url, ReceiptQuery(source_id="pricing.md", version=3), tenant="globex") == ["r5"]


def check_pages(url: str) -> None:
    for query in (ReceiptQuery(), ReceiptQuery(newest_first=True)):
        seen, after = [], None
        with session_scope(url) as session:
            while page := list_receipts(session, "acme", query, 2, after):
                seen += [r.id for r in page]
                after = (page[-1].created_at, page[-1].id)
        assert seen == ids(url, query)


def test_filters_and_pages_on_sqlite(sqlite_url):
    seed(sqlite_url)
    check_filters(sqlite_url)
    check_pages(sqlite_url)


@pytest.mark.integration
def test_filters_and_pages_on_postgresql(pg_url):
    seed(pg_url)
    check_filters(pg_url)
    check_pages(pg_url)


def test_receipt_citations_are_backfilled_by_the_migration(sqlite_url):
    seed(sqlite_url)
    migrate.downgrade(sqlite_url, "0003_per_tenant_logs")
    migrate.upgrade(sqlite_url)
    assert ids(sqlite_url, ReceiptQuery(source_id="pricing.md", version=3)) == ["r0", "r2", "r4"]


# ---- the incident bundle --------------------------------------------------------------------


def bundle_of(url: str, receipt_id: str = "r1") -> bytes:
    with session_scope(url) as session:
        row = session.get(Receipt, receipt_id)
        proof = audit_log.inclusion_proof(session, row.tenant_id, receipt_id)
        return incident.build_bundle(
            receipt={"id": row.id, "status": row.status, "created_at": row.body["created_at"],
                     "body": row.body},
            leaf_data=audit_log.receipt_leaf_data(session, row),
            proof=proof,
            root={"tree_size": proof["tree_size"], "root": proof["root"]},
            replay={"receipt_id": receipt_id, "verdict": "identical", "token_agreement": 1.0},
            exported_at=T0.isoformat(),
        )


def test_bundle_verifies_and_every_changed_byte_is_caught(sqlite_url):
    raw = bundle_of(seed(sqlite_url))
    report = incident.verify_bundle(raw)
    assert report.ok, report.problems
    assert (report.receipt_id, report.tree_size, report.verdict) == ("r1", 5, "identical")  # acme's tree
    # Canonical JSON has no insignificant byte: changing any one of them must fail the check.
    for at in range(len(raw) - 1):  # the final newline is not content
        flipped = bytearray(raw)
        flipped[at] = ord("0") if raw[at] != ord("0") else ord("1")
        assert not incident.verify_bundle(bytes(flipped)).ok, f"byte {at} changed unnoticed"


def test_bundle_of_an_edited_receipt_fails_its_inclusion_proof(sqlite_url):
    url = seed(sqlite_url)
    with session_scope(url, write=True) as session:
        body = {**session.get(Receipt, "r1").body, "inherent.output.text": "a better story"}
        session.execute(update(Receipt).where(Receipt.id == "r1").values(body=body))
    # Exported after the edit: self-consistent, checksum fine, but the leaf is not the logged one.
    problems = incident.verify_bundle(bundle_of(url)).problems
    assert len(problems) == 1 and problems[0].startswith("inclusion proof fails")


def test_bundle_with_the_checksum_recomputed_still_needs_the_body_hash(sqlite_url):
    raw = json.loads(bundle_of(seed(sqlite_url)))
    raw["receipt"]["body"]["inherent.output.text"] = "a better story"
    content = {k: v for k, v in raw.items() if k != "checksum"}
    raw["checksum"] = incident.checksum(content)
    problems = incident.verify_bundle(json.dumps(raw).encode()).problems
    assert problems == [
        "the receipt body does not hash to the body hash its audit leaf commits to"
    ]


def test_cli_verify_bundle_exit_codes(sqlite_url, tmp_path):
    raw = bundle_of(seed(sqlite_url))
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_bytes(raw)
    bad.write_bytes(raw.replace(b'"verdict":"identical"', b'"verdict":"identicaL"'))
    runner = CliRunner()
    ok = runner.invoke(app, ["audit", "verify-bundle", str(good)])
    assert ok.exit_code == 0 and "bundle verified" in ok.stdout and "r1" in ok.stdout
    report = incident.verify_bundle(raw)
    pinned = runner.invoke(
        app, ["audit", "verify-bundle", str(good), "--root", f"{report.tree_size}:{report.root}"]
    )
    assert pinned.exit_code == 0
    other_root = runner.invoke(app, ["audit", "verify-bundle", str(good), "--root", f"5:{'0' * 64}"])
    assert other_root.exit_code == 1 and "is not the published" in other_root.stderr
    failed = runner.invoke(app, ["audit", "verify-bundle", str(bad)])
    assert failed.exit_code == 1 and "checksum mismatch" in failed.stderr
    missing = runner.invoke(app, ["audit", "verify-bundle", str(tmp_path / "nope.json")])
    assert missing.exit_code == 1 and "cannot read" in missing.stderr
    assert "Traceback" not in failed.output + missing.output


def test_a_page_costs_the_same_however_many_receipts_there_are(sqlite_url):
    """A page of a tenant's receipts reads that page's rows: the database does the same work
    whether the store holds a hundred receipts or ten times as many, the tenant's own or other
    tenants', with or without the planner's statistics (SQLite's virtual machine steps)."""
    seed(sqlite_url)

    def write(tenant: str, count: int, start: int) -> None:
        with session_scope(sqlite_url, write=True) as session:
            session.execute(insert(Receipt), [
                {"id": f"{tenant}-{i}", "tenant_id": tenant, "status": "ok", "snapshot_epoch": 1,
                 "model_id": "m", "weights_hash": "w", "prompt_hash": "p", "output_hash": "o",
                 "body": {}, "created_at": T0 + timedelta(days=1, seconds=i)}
                for i in range(start, start + count)
            ])

    def steps_for_a_page(query: ReceiptQuery) -> int:
        steps = [0]
        with session_scope(sqlite_url) as session:
            driver = session.connection().connection.driver_connection

            def count() -> int:
                steps[0] += 1
                return 0

            driver.set_progress_handler(count, 1)
            try:
                assert len(list_receipts(session, "acme", query, 2)) == 2
            finally:
                driver.set_progress_handler(None, 1)
        return steps[0]

    queries = [ReceiptQuery(), ReceiptQuery(status="ok")]
    write("acme", 50, 0)
    write("globex", 50, 0)
    before = [steps_for_a_page(query) for query in queries]
    write("acme", 450, 50)
    write("globex", 450, 50)
    assert [steps_for_a_page(query) for query in queries] == before
    with session_scope(sqlite_url, write=True) as session:
        session.execute(text("ANALYZE"))
    assert [steps_for_a_page(query) for query in queries] == before
