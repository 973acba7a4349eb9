"""The tamper-evident audit log: an append-only RFC 6962 Merkle log kept in SQL.

Each leaf is canonical JSON of a small payload that commits to one event: a receipt (its id,
tenant and the BLAKE3 of its full body) or a truth-store change (a version opened or closed).
``verify`` recomputes every leaf from the rows it names, so an edited, deleted or reordered
receipt is found and named; comparing the root with one published earlier catches a rewrite
of the log itself.
"""

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, insert, literal, select, text
from sqlalchemy.orm import Session

from provenance import merkle
from provenance.hashing import blake3_hex, canonical_json
from provenance.models import AuditLeaf, Receipt, SourceVersion


def receipt_leaf_payload(receipt: Receipt) -> dict[str, Any]:
    """Commits to the whole row: the body by hash, the indexed columns by value."""
    return {
        "receipt_id": receipt.id,
        "tenant_id": receipt.tenant_id,
        "api_key_id": receipt.api_key_id,
        "status": receipt.status,
        "snapshot_epoch": receipt.snapshot_epoch,
        "model_id": receipt.model_id,
        "weights_hash": receipt.weights_hash,
        "prompt_hash": receipt.prompt_hash,
        "output_hash": receipt.output_hash,
        "body_hash": blake3_hex(canonical_json(receipt.body)),
    }


VERSION_EVENTS = {"version_opened": "valid_from_epoch", "version_closed": "valid_to_epoch"}


def version_event_payload(version: SourceVersion, kind: str) -> dict[str, Any]:
    return {
        "tenant_id": version.tenant_id,
        "source_id": version.source_id,
        "version": version.version,
        "content_hash": version.content_hash,
        "epoch": getattr(version, VERSION_EVENTS[kind]),
        "status": version.status if kind == "version_closed" else "active",
    }


def append_version_event(session: Session, version: SourceVersion, kind: str) -> int:
    """Log a version opened or closed; call it after the row holds its new epoch bounds."""
    ref = f"{version.tenant_id}/{version.source_id}@{version.version}"
    return append_leaf(session, kind, ref, version.tenant_id, version_event_payload(version, kind))


def append_leaf(
    session: Session, kind: str, ref: str, tenant_id: str | None, payload: dict[str, Any]
) -> int:
    """Append one leaf inside the caller's transaction and return its position (seq)."""
    data = canonical_json({"kind": kind, "ref": ref, "payload": payload})
    digest = merkle.leaf_hash(data).hex()
    if session.get_bind().dialect.name == "postgresql":
        # Serialize appenders: the next seq is max + 1 and must not be taken twice.
        session.execute(text("SELECT pg_advisory_xact_lock(6962)"))
    next_seq = select(func.coalesce(func.max(AuditLeaf.seq) + 1, 0)).scalar_subquery()
    statement = (
        insert(AuditLeaf)
        .from_select(
            ["seq", "kind", "ref", "tenant_id", "payload", "leaf_hash"],
            select(
                next_seq,
                literal(kind),
                literal(ref),
                literal(tenant_id),
                literal(payload, AuditLeaf.payload.type),
                literal(digest),
            ),
        )
        .returning(AuditLeaf.seq)
    )
    return session.execute(statement).scalar_one()


def append_receipt(session: Session, receipt: Receipt) -> int:
    return append_leaf(
        session, "receipt", receipt.id, receipt.tenant_id, receipt_leaf_payload(receipt)
    )


def leaf_hashes(session: Session, size: int | None = None) -> list[bytes]:
    query = select(AuditLeaf.leaf_hash).order_by(AuditLeaf.seq)
    if size is not None:
        query = query.limit(size)
    return [bytes.fromhex(h) for h in session.scalars(query)]


def tree_size(session: Session) -> int:
    return session.scalar(select(func.count()).select_from(AuditLeaf)) or 0


def root(session: Session, size: int | None = None) -> tuple[int, bytes]:
    leaves = leaf_hashes(session, size)
    if size is not None and len(leaves) < size:
        raise ValueError(f"the log holds {len(leaves)} leaves, fewer than {size}")
    return len(leaves), merkle.root(leaves)


def inclusion_proof(session: Session, ref: str, kind: str = "receipt") -> dict[str, Any] | None:
    seq = session.scalar(select(AuditLeaf.seq).where(AuditLeaf.kind == kind, AuditLeaf.ref == ref))
    if seq is None:
        return None
    leaves = leaf_hashes(session)
    return {
        "leaf_index": seq,
        "tree_size": len(leaves),
        "leaf_hash": leaves[seq].hex(),
        "root": merkle.root(leaves).hex(),
        "audit_path": [h.hex() for h in merkle.inclusion_proof(seq, leaves)],
    }


def consistency_proof(session: Session, old_size: int, new_size: int) -> dict[str, Any]:
    leaves = leaf_hashes(session, new_size)
    if len(leaves) < new_size:
        raise ValueError(f"the log holds {len(leaves)} leaves, fewer than {new_size}")
    return {
        "first": old_size,
        "second": new_size,
        "first_root": merkle.root(leaves[:old_size]).hex(),
        "second_root": merkle.root(leaves).hex(),
        "consistency": [h.hex() for h in merkle.consistency_proof(old_size, leaves)],
    }


@dataclass
class VerifyReport:
    size: int
    root: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _expected_payload(session: Session, leaf: AuditLeaf) -> dict[str, Any] | None:
    """What the leaf's payload must be, recomputed from the rows it names (None: row missing)."""
    if leaf.kind == "receipt":
        receipt = session.get(Receipt, leaf.ref)
        return None if receipt is None else receipt_leaf_payload(receipt)
    if leaf.kind in VERSION_EVENTS:
        p = leaf.payload
        row = session.get(SourceVersion, (p.get("tenant_id"), p.get("source_id"), p.get("version")))
        return None if row is None else version_event_payload(row, leaf.kind)
    return leaf.payload


def verify(session: Session, published_root: tuple[int, str] | None = None) -> VerifyReport:
    """Recompute every leaf from the database and name each receipt or event that does not match."""
    leaves = list(session.scalars(select(AuditLeaf).order_by(AuditLeaf.seq)))
    problems: list[str] = []
    for position, leaf in enumerate(leaves):
        if leaf.seq != position:
            problems.append(
                f"audit leaf {position} is missing (next leaf is seq {leaf.seq}): a leaf was deleted"
            )
            break
    for leaf in leaves:
        recomputed = merkle.leaf_hash(
            canonical_json({"kind": leaf.kind, "ref": leaf.ref, "payload": leaf.payload})
        ).hex()
        if recomputed != leaf.leaf_hash:
            problems.append(
                f"audit leaf {leaf.seq} ({leaf.kind} {leaf.ref}): stored leaf hash does not match its payload"
            )
            continue
        expected = _expected_payload(session, leaf)
        if expected is None:
            problems.append(
                f"{leaf.kind} {leaf.ref} (leaf {leaf.seq}): the row it names was deleted"
            )
        elif expected != leaf.payload:
            problems.append(
                f"{leaf.kind} {leaf.ref} (leaf {leaf.seq}): the row was edited after it was logged"
            )
    logged = {leaf.ref for leaf in leaves if leaf.kind == "receipt"}
    for receipt_id in session.scalars(select(Receipt.id)):
        if receipt_id not in logged:
            problems.append(f"receipt {receipt_id}: not in the audit log (inserted outside it)")
    hashes = [bytes.fromhex(leaf.leaf_hash) for leaf in leaves]
    current_root = merkle.root(hashes)
    if published_root is not None:
        size, expected_root = published_root
        if size > len(hashes):
            problems.append(f"published root covers {size} leaves but the log holds {len(hashes)}")
        elif merkle.root(hashes[:size]).hex() != expected_root:
            problems.append(
                f"the first {size} leaves no longer hash to the published root: the log was rewritten"
            )
    return VerifyReport(size=len(hashes), root=current_root.hex(), problems=problems)
