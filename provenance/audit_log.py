"""The tamper-evident audit log: an append-only RFC 6962 Merkle log per tenant, kept in SQL.

Each leaf is canonical JSON of a small payload that commits to one event: a receipt (its id,
tenant and the BLAKE3 of its full body) or a truth-store change (a version opened or closed),
plus a random nonce, so a leaf hash cannot confirm a guess of a payload's fields (a document's
content hash, say). Every tenant has its own tree: its leaves are numbered from 0, and roots and
proofs cover its leaves only, so one tenant never sees another's log grow.

The log scales like a transparency log: each append stores the hashes of the complete subtrees
its leaf completes (``audit_nodes``) and the tenant's frontier (``audit_heads``), so a root, an
inclusion proof or a consistency proof reads O(log n) rows. ``verify`` still recomputes every
leaf from the rows it names and every stored subtree from the leaves, so an edited, deleted or
reordered receipt, or a forged subtree hash, is found and named; comparing a root with one
published earlier catches a rewrite of the log itself.
"""

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, union_all, update
from sqlalchemy.orm import Session

from provenance import merkle
from provenance.db import insert_missing
from provenance.driver_sql import DriverStatement
from provenance.hashing import blake3_hex, canonical_json
from provenance.models import (
    AuditHead,
    AuditLeaf,
    AuditNode,
    Receipt,
    ReceiptRow,
    SourceVersion,
    utcnow,
)


def receipt_leaf_payload(receipt: Receipt | ReceiptRow) -> dict[str, Any]:
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
        # A row the hot path writes holds the body's canonical JSON already; a stored receipt's
        # body reads back as the dict whose canonical JSON that was.
        "body_hash": blake3_hex(
            receipt.body if isinstance(receipt, ReceiptRow) else canonical_json(receipt.body)
        ),
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


def leaf_data(kind: str, ref: str, payload: dict[str, Any], nonce: str | None) -> bytes:
    """The bytes a leaf hash commits to (leaves logged before nonces existed have none)."""
    leaf: dict[str, Any] = {"kind": kind, "ref": ref, "payload": payload}
    if nonce is not None:
        leaf["nonce"] = nonce
    return canonical_json(leaf)


def receipt_leaf_data(session: Session, receipt: Receipt) -> bytes | None:
    """The bytes a receipt's leaf hashes (after the 0x00 prefix), recomputed from the row as it is
    now with the leaf's logged nonce: a client hashing them finds the logged leaf only if the row
    was not edited since. None when the receipt is not in its tenant's log."""
    nonce = session.execute(
        select(AuditLeaf.nonce).where(
            AuditLeaf.tenant_id == receipt.tenant_id,
            AuditLeaf.kind == "receipt",
            AuditLeaf.ref == receipt.id,
        )
    ).first()
    if nonce is None:
        return None
    return leaf_data("receipt", receipt.id, receipt_leaf_payload(receipt), nonce[0])


@dataclass(frozen=True, slots=True)
class LeafEntry:
    kind: str
    ref: str
    payload: dict[str, Any]


def append_version_events(
    session: Session, tenant_id: str, events: Sequence[tuple[SourceVersion, str]]
) -> list[int]:
    """Log versions opened or closed, ``(row, kind)`` in order, as one append (one head update
    for the lot: an epoch of many sources holds the write lock no longer than it must); call it
    after the rows hold their new epoch bounds."""
    entries = [
        LeafEntry(kind, f"{row.tenant_id}/{row.source_id}@{row.version}",
                  version_event_payload(row, kind))
        for row, kind in events
    ]
    return append_leaves(session, tenant_id, entries)


def append_leaf(
    session: Session | Connection, kind: str, ref: str, tenant_id: str, payload: dict[str, Any]
) -> int:
    """Append one leaf to the tenant's log inside the caller's transaction; return its index."""
    return append_leaves(session, tenant_id, [LeafEntry(kind, ref, payload)])[0]


def receipt_leaf(receipt: Receipt | ReceiptRow) -> LeafEntry:
    """The leaf that logs a receipt, for ``append_leaves`` of the receipt's tenant."""
    return LeafEntry("receipt", receipt.id, receipt_leaf_payload(receipt))


_LEAF, _NODE, _HEAD = AuditLeaf.__table__, AuditNode.__table__, AuditHead.__table__
# Every answer appends a leaf: these run on the driver's cursor (provenance/driver_sql.py).
_ADVANCE_HEAD = DriverStatement(
    update(_HEAD)
    .where(_HEAD.c.tenant_id == bindparam("tenant"))
    .values(size=_HEAD.c.size + bindparam("advance"))
    .returning(_HEAD.c.size, _HEAD.c.frontier)
)
_SET_FRONTIER = DriverStatement(
    update(_HEAD).where(_HEAD.c.tenant_id == bindparam("tenant")).values(frontier=bindparam("frontier"))
)
_INSERT_LEAVES, _INSERT_NODES = DriverStatement(insert(_LEAF)), DriverStatement(insert(_NODE))


def _lock_head(
    session: Session | Connection, tenant_id: str, advance: int
) -> tuple[int, list[str]]:
    """Take the tenant's head row lock until the transaction ends, reserve ``advance`` leaf
    indexes, and return the size before them and the frontier at that size.

    The UPDATE's row lock queues appenders of one tenant in any process (on SQLite the database
    write lock does); under READ COMMITTED, which the engine pins, a waiter re-reads the row the
    holder committed, so no two appenders ever take the same index.
    """
    params = {"tenant": tenant_id, "advance": advance}
    rows = _ADVANCE_HEAD.execute(session, params)
    if not rows:  # the tenant's first leaf; a concurrent first appender may create it too
        insert_missing(session, AuditHead, [{"tenant_id": tenant_id, "size": 0, "frontier": []}])
        rows = _ADVANCE_HEAD.execute(session, params)
    size, frontier = rows[0]
    return size - advance, list(frontier)


def _leaf_row(tenant_id: str, seq: int, entry: LeafEntry) -> dict[str, Any]:
    nonce = secrets.token_hex(16)
    digest = merkle.leaf_hash(leaf_data(entry.kind, entry.ref, entry.payload, nonce))
    return {
        "tenant_id": tenant_id,
        "seq": seq,
        "kind": entry.kind,
        "ref": entry.ref,
        "payload": entry.payload,
        "nonce": nonce,
        "leaf_hash": digest.hex(),
        "created_at": utcnow(),  # the column's default, which only Core would have applied
    }


def append_leaves(
    session: Session | Connection, tenant_id: str, entries: Sequence[LeafEntry]
) -> list[int]:
    """Append leaves to the tenant's log in the caller's transaction; return their indexes.

    Writes each leaf, the subtree hashes it completes (amortized one per leaf, at most log2 n)
    and the new frontier.
    """
    if not entries:
        return []
    size, frontier = _lock_head(session, tenant_id, len(entries))
    leaves = [_leaf_row(tenant_id, seq, entry) for seq, entry in enumerate(entries, start=size)]
    stack, completed = merkle.extend(
        [bytes.fromhex(h) for h in frontier], size, [bytes.fromhex(x["leaf_hash"]) for x in leaves]
    )
    nodes = [
        {"tenant_id": tenant_id, "node": merkle.node_number(level, index), "hash": digest.hex()}
        for level, index, digest in completed
    ]
    _INSERT_LEAVES.executemany(session, leaves)
    if nodes:
        _INSERT_NODES.executemany(session, nodes)
    _SET_FRONTIER.execute(session, {"tenant": tenant_id, "frontier": [h.hex() for h in stack]})
    return [leaf["seq"] for leaf in leaves]


# ---------------------------------------------------------------------------------------------
# Reading: O(log n) rows per root or proof
# ---------------------------------------------------------------------------------------------


# Statements built once: the SQL compilation cache serves them whatever the number of subtrees
# asked (expanding IN lists), where a statement built per call would cost more than the query.
_READ_HEAD = select(_HEAD.c.size, _HEAD.c.frontier).where(_HEAD.c.tenant_id == bindparam("tenant"))
# Leaves and stored subtrees in one round trip, both by node number (a leaf's is 2 * seq).
_READ_SUBTREES = union_all(
    select((_LEAF.c.seq * 2).label("node"), _LEAF.c.leaf_hash.label("hash")).where(
        _LEAF.c.tenant_id == bindparam("tenant"),
        _LEAF.c.seq.in_(bindparam("seqs", expanding=True)),
    ),
    select(_NODE.c.node, _NODE.c.hash).where(
        _NODE.c.tenant_id == bindparam("tenant"),
        _NODE.c.node.in_(bindparam("nodes", expanding=True)),
    ),
)
_FIND_LEAF = (
    select(_LEAF.c.seq, _HEAD.c.size, _HEAD.c.frontier)
    .join(_HEAD, _HEAD.c.tenant_id == _LEAF.c.tenant_id)
    .where(
        _LEAF.c.tenant_id == bindparam("tenant"),
        _LEAF.c.ref == bindparam("ref"),
        _LEAF.c.kind == bindparam("kind"),
    )
)


def _head(session: Session, tenant_id: str) -> tuple[int, list[bytes]]:
    row = session.execute(_READ_HEAD, {"tenant": tenant_id}).one_or_none()
    return (0, []) if row is None else (row.size, [bytes.fromhex(h) for h in row.frontier])


def _tree_root(subtree_roots: list[bytes]) -> bytes:
    return merkle.fold(subtree_roots) if subtree_roots else merkle.root([])


def _stored_subtrees(
    session: Session, tenant_id: str, keys: set[tuple[int, int]]
) -> dict[tuple[int, int], bytes]:
    """Hashes of complete subtrees ``(level, index)``: leaves from the log, the rest stored.

    Asking past the end of the log is a ValueError: found out from what is missing, so a read
    within the log costs this one statement and no look at the head.
    """
    rows = session.execute(
        _READ_SUBTREES,
        {
            "tenant": tenant_id,
            "seqs": [index for level, index in keys if level == 0],
            "nodes": [merkle.node_number(level, index) for level, index in keys if level],
        },
    )
    found = {merkle.node_position(node): bytes.fromhex(digest) for node, digest in rows}
    missing = keys - found.keys()
    if missing:
        size = tree_size(session, tenant_id)
        needed = max((index + 1) << level for level, index in keys)
        if needed > size:
            raise ValueError(f"the log holds {size} leaves, fewer than {needed}")
        raise RuntimeError(
            f"the audit log of tenant {tenant_id!r} lacks stored subtrees {sorted(missing)[:4]}; "
            "run 'inherent audit verify'"
        )
    return found


def _range_hashes(
    session: Session, tenant_id: str, ranges: list[tuple[int, int]]
) -> list[bytes]:
    """MTH(D[a:b]) for each range, from one read of the subtrees that cover them all."""
    covers = [merkle.subtrees(a, b) for a, b in ranges]
    stored = _stored_subtrees(session, tenant_id, {key for cover in covers for key in cover})
    return [merkle.fold([stored[key] for key in cover]) for cover in covers]


def tenants(session: Session) -> list[str]:
    """Every tenant that has a log."""
    return list(session.scalars(select(AuditHead.tenant_id).order_by(AuditHead.tenant_id)))


def tree_size(session: Session, tenant_id: str) -> int:
    return _head(session, tenant_id)[0]


def root(session: Session, tenant_id: str, size: int | None = None) -> tuple[int, bytes]:
    """The tenant's tree size and root, now or at an earlier ``size``."""
    current, frontier = _head(session, tenant_id)
    if size is None or size == current:
        return current, _tree_root(frontier)
    if size > current:
        raise ValueError(f"the log holds {current} leaves, fewer than {size}")
    if size == 0:
        return 0, merkle.root([])
    return size, _range_hashes(session, tenant_id, [(0, size)])[0]


def inclusion_proof(
    session: Session, tenant_id: str, ref: str, kind: str = "receipt"
) -> dict[str, Any] | None:
    """The leaf's audit path to the tenant's current root (None: not in the tenant's log)."""
    found = session.execute(_FIND_LEAF, {"tenant": tenant_id, "ref": ref, "kind": kind}).first()
    if found is None:
        return None
    seq, size, frontier = found.seq, found.size, [bytes.fromhex(h) for h in found.frontier]
    leaf, *path = _range_hashes(
        session, tenant_id, [(seq, seq + 1), *merkle.inclusion_ranges(seq, size)]
    )
    return {
        "leaf_index": seq,
        "tree_size": size,
        "leaf_hash": leaf.hex(),
        "root": _tree_root(frontier).hex(),
        "audit_path": [h.hex() for h in path],
    }


def consistency_proof(
    session: Session, tenant_id: str, old_size: int, new_size: int
) -> dict[str, Any]:
    """Proof that the tenant's tree at ``old_size`` is a prefix of its tree at ``new_size``."""
    proof = merkle.consistency_ranges(old_size, new_size)
    first, second, *path = _range_hashes(
        session, tenant_id, [(0, old_size), (0, new_size), *proof]
    )
    return {
        "first": old_size,
        "second": new_size,
        "first_root": first.hex(),
        "second_root": second.hex(),
        "consistency": [h.hex() for h in path],
    }


# ---------------------------------------------------------------------------------------------
# Verifying: everything recomputed from the leaves
# ---------------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    trees: dict[str, tuple[int, str]] = field(default_factory=dict)  # tenant -> (size, root)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.trees.values())


def _expected_payload(session: Session, leaf: AuditLeaf) -> dict[str, Any] | None:
    """What the leaf's payload must be, recomputed from the rows it names (None: row missing)."""
    if leaf.kind == "receipt":
        receipt = session.get(Receipt, leaf.ref)
        if receipt is None or receipt.tenant_id != leaf.tenant_id:
            return None
        return receipt_leaf_payload(receipt)
    if leaf.kind in VERSION_EVENTS:
        p = leaf.payload
        row = session.get(SourceVersion, (p.get("tenant_id"), p.get("source_id"), p.get("version")))
        return None if row is None else version_event_payload(row, leaf.kind)
    return leaf.payload


def _check_leaves(session: Session, tenant_id: str, leaves: list[AuditLeaf]) -> list[str]:
    problems: list[str] = []
    for position, leaf in enumerate(leaves):
        if leaf.seq != position:
            problems.append(
                f"tenant {tenant_id}: audit leaf {position} is missing (next leaf is seq "
                f"{leaf.seq}): a leaf was deleted"
            )
            break
    for leaf in leaves:
        name = f"{leaf.kind} {leaf.ref} (leaf {leaf.seq} of tenant {tenant_id})"
        recomputed = merkle.leaf_hash(leaf_data(leaf.kind, leaf.ref, leaf.payload, leaf.nonce))
        if recomputed.hex() != leaf.leaf_hash:
            problems.append(f"{name}: stored leaf hash does not match its payload")
            continue
        expected = _expected_payload(session, leaf)
        if expected is None:
            problems.append(f"{name}: the row it names was deleted")
        elif expected != leaf.payload:
            problems.append(f"{name}: the row was edited after it was logged")
    return problems


def _check_stored_tree(session: Session, tenant_id: str, hashes: list[bytes]) -> list[str]:
    """Every stored subtree and the head must be what the leaves hash to: proofs are served
    from them, so a forged one would prove a leaf the log does not hold."""
    problems: list[str] = []
    stored = {
        merkle.node_position(node): digest
        for node, digest in session.execute(
            select(AuditNode.node, AuditNode.hash).where(AuditNode.tenant_id == tenant_id)
        )
    }
    level, nodes = 0, hashes
    while len(nodes) > 1:
        level += 1
        nodes = [merkle.node_hash(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
        for index, node in enumerate(nodes):
            digest = stored.pop((level, index), None)
            if digest != node.hex():
                state = "is missing" if digest is None else "does not match its leaves"
                problems.append(
                    f"tenant {tenant_id}: stored subtree (level {level}, index {index}) {state}"
                )
    problems += [
        f"tenant {tenant_id}: stored subtree (level {level}, index {index}) covers leaves the log "
        "does not hold"
        for level, index in sorted(stored)
    ]
    size, frontier = _head(session, tenant_id)
    if size != len(hashes) or _tree_root(frontier) != merkle.root(hashes):
        problems.append(
            f"tenant {tenant_id}: the stored head (size {size}) does not match the log's "
            f"{len(hashes)} leaves"
        )
    return problems


def verify(
    session: Session, published_roots: Mapping[str, tuple[int, str]] | None = None
) -> VerifyReport:
    """Recompute every tenant's leaves from the database and its tree from the leaves; name each
    receipt, event or stored hash that does not match. ``published_roots``: tenant -> (size,
    root hex) published earlier."""
    published_roots = published_roots or {}
    report = VerifyReport()
    logs = (
        set(session.scalars(select(AuditLeaf.tenant_id).distinct()))
        | set(tenants(session))
        | set(published_roots)
    )
    logged: set[tuple[str, str]] = set()
    for tenant_id in sorted(logs):
        leaves = list(
            session.scalars(
                select(AuditLeaf).where(AuditLeaf.tenant_id == tenant_id).order_by(AuditLeaf.seq)
            )
        )
        logged.update((tenant_id, leaf.ref) for leaf in leaves if leaf.kind == "receipt")
        report.problems += _check_leaves(session, tenant_id, leaves)
        hashes = [bytes.fromhex(leaf.leaf_hash) for leaf in leaves]
        report.problems += _check_stored_tree(session, tenant_id, hashes)
        report.trees[tenant_id] = (len(hashes), merkle.root(hashes).hex())
        if tenant_id in published_roots:
            size, expected_root = published_roots[tenant_id]
            if size > len(hashes):
                report.problems.append(
                    f"tenant {tenant_id}: published root covers {size} leaves but the log holds "
                    f"{len(hashes)}"
                )
            elif merkle.root(hashes[:size]).hex() != expected_root:
                report.problems.append(
                    f"tenant {tenant_id}: the first {size} leaves no longer hash to the published "
                    "root: the log was rewritten"
                )
    for receipt_id, tenant_id in session.execute(select(Receipt.id, Receipt.tenant_id)):
        if (tenant_id, receipt_id) not in logged:
            report.problems.append(
                f"receipt {receipt_id}: not in tenant {tenant_id}'s audit log (inserted outside it)"
            )
    return report
