"""Several OS processes append to the audit log of one PostgreSQL at once, as several gateway
processes do: appends serialize per tenant, never fail on a duplicate key (also when the server's
default isolation is SERIALIZABLE), every receipt is in its tenant's log, and
``inherent audit verify`` finds the log intact."""

import json
import os
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import func, select

from provenance import audit_log, migrate
from provenance.db import session_scope
from provenance.models import AuditLeaf, Receipt, Tenant

pytestmark = pytest.mark.integration

APPENDER = Path(__file__).with_name("concurrent_appender.py")
PROCESSES, RECEIPTS = 3, 60


def run_appenders(url: str, tmp_path: Path, env: dict[str, str]) -> list[list[list[str]]]:
    """Start the writers, release them together once all are connected, return what each wrote."""
    ready = tmp_path / "ready"
    ready.mkdir()
    # Two writers share tenant acme's tree; the third also writes beta's.
    tenants = [["acme"], ["acme"], ["acme", "beta"]]
    writers = [
        subprocess.Popen(
            [sys.executable, str(APPENDER), url, f"p{n}", str(ready), str(RECEIPTS), *tenants[n]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(PROCESSES)
    ]
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < PROCESSES:
        assert time.monotonic() < deadline, "the writers did not start"
        assert all(w.poll() is None for w in writers), [w.communicate() for w in writers]
        time.sleep(0.05)
    (ready / "go").touch()
    written = []
    for writer in writers:
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err
        assert "duplicate key" not in err and "could not serialize" not in err
        written.append([json.loads(line) for line in out.splitlines()])
    return written


@pytest.mark.parametrize("server_isolation", ["default", "serializable"])
def test_processes_appending_at_once_lose_nothing_and_verify(pg_url, tmp_path, server_isolation):
    migrate.upgrade(pg_url)
    with session_scope(pg_url, write=True) as session:
        session.add_all([Tenant(id="acme", name="acme"), Tenant(id="beta", name="beta")])
    env = {**os.environ}
    if server_isolation == "serializable":
        # What an operator's postgresql.conf may say; the engine must not depend on it.
        env["PGOPTIONS"] = "-c default_transaction_isolation=serializable"
    written = run_appenders(pg_url, tmp_path, env)

    assert [len(w) for w in written] == [RECEIPTS] * PROCESSES
    expected = {"acme": 0, "beta": 0}
    for tenant, _ in (row for w in written for row in w):
        expected[tenant] += 1
    with session_scope(pg_url) as session:
        assert session.scalar(select(func.count()).select_from(Receipt)) == RECEIPTS * PROCESSES
        for tenant, count in expected.items():
            assert audit_log.tree_size(session, tenant) == count
            seqs = session.scalars(
                select(AuditLeaf.seq).where(AuditLeaf.tenant_id == tenant).order_by(AuditLeaf.seq)
            ).all()
            assert seqs == list(range(count))
        # The writers really overlapped: acme's log interleaves the processes' receipts.
        refs = session.scalars(
            select(AuditLeaf.ref).where(AuditLeaf.tenant_id == "acme").order_by(AuditLeaf.seq)
        ).all()
        runs = 1 + sum(a.split("_")[1] != b.split("_")[1] for a, b in pairwise(refs))
        assert runs > PROCESSES, "the writers ran one after another, not at once"

    cli = Path(sys.executable).with_name("inherent")
    verify = subprocess.run(
        [str(cli), "audit", "verify"],
        env={**os.environ, "INHERENT_DATABASE_URL": pg_url, "INHERENT_DATA_DIR": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0, verify.stderr
    assert f"audit log intact: {RECEIPTS * PROCESSES} leaves in 2 tenant logs" in verify.stdout
