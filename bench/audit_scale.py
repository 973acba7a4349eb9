"""How the audit log scales: appends 1,000,000 leaves in batches to one tenant's log and, at 1k,
100k and 1M leaves, times the reads the API serves: the root (``GET /v1/audit/root``), an
inclusion proof for a random receipt (``GET /v1/receipts/{id}``) and a consistency proof from a
random earlier size to now (``GET /v1/audit/consistency``), each in its own transaction as a
request runs it. On SQLite and, given a server URL, on PostgreSQL (a throwaway database there).

For comparison the same run times the old way at 10k leaves: the root recomputed from every
leaf hash, which is what each of these reads cost before subtrees were stored
(``recompute_root_p50_ms_10k``). Last line: one JSON object, ``{"sqlite": {...},
"postgresql": {...}, "cpu": ...}``, with p50 and p99 of each read at each size.

    flock /tmp/inherent-bench.lock .venv/bin/python -m bench.audit_scale \\
        [--leaves 1000000] [--pg-url postgresql+psycopg://...] [--samples 200]
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from bench import cpu
from provenance import audit_log, merkle, migrate
from provenance.db import get_engine, session_scope
from provenance.models import AuditLeaf

TENANT = "bench"
CHECKPOINTS = {1_000: "1k", 10_000: "10k", 100_000: "100k", 1_000_000: "1m"}
BASELINE_AT = 10_000


def stats(samples_ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(samples_ms), 3),
        "p99": round(statistics.quantiles(samples_ms, n=100, method="inclusive")[98], 3),
    }


def leaf(i: int) -> audit_log.LeafEntry:
    """A leaf shaped like a receipt's: ids and hashes of realistic length."""
    digest = f"{i:064x}"
    return audit_log.LeafEntry(
        "receipt",
        f"rcpt_{i:024x}",
        {
            "receipt_id": f"rcpt_{i:024x}",
            "tenant_id": TENANT,
            "status": "ok",
            "snapshot_epoch": 1,
            "model_id": "SmolLM2-135M-Instruct",
            "weights_hash": digest,
            "prompt_hash": digest,
            "output_hash": digest,
            "body_hash": digest,
        },
    )


def timed(url: str, samples: int, read: Callable[[Session, random.Random], object]) -> dict:
    rng = random.Random(6962)
    taken = []
    for _ in range(samples):
        start = time.perf_counter()
        with session_scope(url) as session:
            read(session, rng)
        taken.append((time.perf_counter() - start) * 1000)
    return stats(taken)


def measure(url: str, size: int, samples: int) -> dict[str, dict]:
    def root(session, _rng):
        return audit_log.root(session, TENANT)

    def inclusion(session, rng):
        found = audit_log.inclusion_proof(session, TENANT, leaf(rng.randrange(size)).ref)
        assert found is not None and found["tree_size"] == size

    def consistency(session, rng):
        return audit_log.consistency_proof(session, TENANT, rng.randint(1, size), size)

    return {
        "root": timed(url, samples, root),
        "inclusion": timed(url, samples, inclusion),
        "consistency": timed(url, samples, consistency),
    }


def check_one_proof(url: str, size: int) -> None:
    """The proofs being timed are real: one of each verifies against the root."""
    with session_scope(url) as session:
        _, root = audit_log.root(session, TENANT)
        got = audit_log.inclusion_proof(session, TENANT, leaf(size // 3).ref)
        old = max(size // 3, 1)
        cons = audit_log.consistency_proof(session, TENANT, old, size)
    assert merkle.verify_inclusion(
        got["leaf_index"], size, bytes.fromhex(got["leaf_hash"]),
        [bytes.fromhex(h) for h in got["audit_path"]], root,
    )
    assert merkle.verify_consistency(
        old, size, bytes.fromhex(cons["first_root"]), root,
        [bytes.fromhex(h) for h in cons["consistency"]],
    )


def recompute_root(session: Session, _rng) -> bytes:
    """The old read path: every leaf hash of the log, then the tree."""
    query = select(AuditLeaf.leaf_hash).where(AuditLeaf.tenant_id == TENANT).order_by(AuditLeaf.seq)
    return merkle.root([bytes.fromhex(h) for h in session.scalars(query)])


def run(name: str, url: str, leaves: int, batch: int, samples: int) -> dict:
    migrate.upgrade(url)
    checkpoints = sorted({*(c for c in CHECKPOINTS if c <= leaves), leaves})
    result: dict = {}
    appending = 0.0
    size = 0
    for checkpoint in checkpoints:
        while size < checkpoint:
            count = min(batch, checkpoint - size)
            start = time.perf_counter()
            with session_scope(url, write=True) as session:
                audit_log.append_leaves(session, TENANT, [leaf(i) for i in range(size, size + count)])
            appending += time.perf_counter() - start
            size += count
        check_one_proof(url, size)
        label = CHECKPOINTS.get(size, str(size))
        reads = measure(url, size, samples)
        line = ", ".join(f"{kind} p50 {s['p50']:.2f} ms p99 {s['p99']:.2f} ms" for kind, s in reads.items())
        print(f"{name} at {size:,} leaves: {line}; appending {size / appending:,.0f} leaves/s so far", flush=True)
        for kind, s in reads.items():
            result[f"{kind}_p50_ms_{label}"] = s["p50"]
            result[f"{kind}_p99_ms_{label}"] = s["p99"]
        if size == BASELINE_AT:
            old = timed(url, max(samples // 10, 5), recompute_root)
            print(f"{name} at {size:,} leaves, old recompute-from-leaves root: p50 {old['p50']:.2f} ms p99 {old['p99']:.2f} ms", flush=True)
            result[f"recompute_root_p50_ms_{label}"] = old["p50"]
    result["append_per_s"] = round(size / appending)
    result["leaves"] = size
    return result


@contextmanager
def throwaway_pg_database(server_url: str) -> Iterator[str]:
    name = f"inherent_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        get_engine.cache_clear()  # close pooled connections so the database can be dropped
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000, help="leaves per append transaction")
    parser.add_argument("--samples", type=int, default=200, help="timed reads of each kind per size")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("INHERENT_TEST_PG_URL", ""),
        help="a PostgreSQL server (a throwaway database is created on it); default "
        "INHERENT_TEST_PG_URL; empty: SQLite only",
    )
    args = parser.parse_args()
    machine = cpu.describe()
    print(f"CPU: {cpu.label(machine)}", flush=True)
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        report["sqlite"] = run("sqlite", f"sqlite:///{tmp}/audit.db", args.leaves, args.batch, args.samples)
    if args.pg_url:
        with throwaway_pg_database(args.pg_url) as url:
            report["postgresql"] = run("postgresql", url, args.leaves, args.batch, args.samples)
    report["cpu"] = machine
    print(json.dumps(report))


if __name__ == "__main__":
    main()
