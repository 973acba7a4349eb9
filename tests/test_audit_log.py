"""The audit log is an RFC 6962 Merkle log: proofs check out under an independent verifier,
and editing, deleting or swapping receipt rows is found and named."""

import json

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import delete, update
from typer.testing import CliRunner

from gateway.cli import app
from provenance import audit_log, merkle, migrate
from provenance.db import session_scope
from provenance.models import Receipt, Tenant


# An independent reading of RFC 6962 section 2.1, written from the recursive definitions
# (MTH, PATH, PROOF) rather than from the implementation under test.
def h_leaf(d: bytes) -> bytes:
    return blake3(b"\x00" + d).digest()


def h_node(a: bytes, b: bytes) -> bytes:
    return blake3(b"\x01" + a + b).digest()


def k_of(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(leaves: list[bytes]) -> bytes:
    if len(leaves) == 0:
        return blake3(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = k_of(len(leaves))
    return h_node(mth(leaves[:k]), mth(leaves[k:]))


def root_from_path(index: int, leaf: bytes, path: list[bytes], n: int) -> bytes:
    """Rebuild MTH(D[n]) from a leaf and its PATH by walking the same recursive split."""
    if n == 1:
        assert not path
        return leaf
    k = k_of(n)
    *inner, sibling = path
    if index < k:
        return h_node(root_from_path(index, leaf, inner, k), sibling)
    return h_node(sibling, root_from_path(index - k, leaf, inner, n - k))


def roots_from_consistency(m: int, leaves_new: int, proof: list[bytes], old_root: bytes) -> tuple[bytes, bytes]:
    """Rebuild (MTH(D[0:m]), MTH(D[0:n])) from PROOF(m, D[n]) via SUBPROOF's recursion."""

    def sub(m: int, n: int, proof: list[bytes], complete: bool) -> tuple[bytes, bytes]:
        if m == n:
            if complete:
                assert not proof
                return old_root, old_root
            (node,) = proof
            return node, node
        k = k_of(n)
        *inner, sibling = proof
        if m <= k:
            old, new = sub(m, k, inner, complete)
            return old, h_node(new, sibling)
        old, new = sub(m - k, n - k, inner, False)
        return h_node(sibling, old), h_node(sibling, new)

    return sub(m, leaves_new, proof, True)


@given(st.integers(min_value=1, max_value=70), st.data())
def test_proofs_verify_independently(n, data):
    leaves = [h_leaf(i.to_bytes(4, "big")) for i in range(n)]
    assert merkle.root(leaves) == mth(leaves)
    index = data.draw(st.integers(min_value=0, max_value=n - 1))
    proof = merkle.inclusion_proof(index, leaves)
    assert root_from_path(index, leaves[index], proof, n) == mth(leaves)
    assert merkle.verify_inclusion(index, n, leaves[index], proof, mth(leaves))
    assert not merkle.verify_inclusion(index, n, h_leaf(b"forged"), proof, mth(leaves))
    m = data.draw(st.integers(min_value=1, max_value=n))
    cproof = merkle.consistency_proof(m, leaves)
    assert roots_from_consistency(m, n, cproof, mth(leaves[:m])) == (mth(leaves[:m]), mth(leaves))
    assert merkle.verify_consistency(m, n, mth(leaves[:m]), mth(leaves), cproof)
    if m < n:
        assert not merkle.verify_consistency(m, n, mth([*leaves[: m - 1], h_leaf(b"x")]), mth(leaves), cproof)


@pytest.fixture
def logged_receipts(sqlite_url):
    migrate.upgrade(sqlite_url)
    with session_scope(sqlite_url, write=True) as session:
        session.add(Tenant(id="acme", name="acme"))
        session.flush()
        for i in range(6):
            receipt = Receipt(
                id=f"r{i}", tenant_id="acme", status="ok", model_id="m", weights_hash="w",
                prompt_hash=f"p{i}", output_hash=f"o{i}", body={"output": f"answer {i}"},
            )
            session.add(receipt)
            session.flush()
            assert audit_log.append_receipt(session, receipt) == i
    return sqlite_url


def problems(url: str, published=None) -> list[str]:
    with session_scope(url) as session:
        return audit_log.verify(session, published).problems


def test_intact_log_verifies_and_proves_inclusion(logged_receipts):
    assert problems(logged_receipts) == []
    with session_scope(logged_receipts) as session:
        proof = audit_log.inclusion_proof(session, "r4")
        consistency = audit_log.consistency_proof(session, 3, 6)
    path = [bytes.fromhex(h) for h in proof["audit_path"]]
    assert root_from_path(4, bytes.fromhex(proof["leaf_hash"]), path, 6).hex() == proof["root"]
    old, new = roots_from_consistency(3, 6, [bytes.fromhex(h) for h in consistency["consistency"]], bytes.fromhex(consistency["first_root"]))
    assert (old.hex(), new.hex()) == (consistency["first_root"], consistency["second_root"]) and new.hex() == proof["root"]


def test_edited_receipt_is_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        session.execute(update(Receipt).where(Receipt.id == "r2").values(body={"output": "a better story"}))
    assert problems(logged_receipts) == ["receipt r2 (leaf 2): the row was edited after it was logged"]


def test_deleted_receipt_is_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        session.execute(delete(Receipt).where(Receipt.id == "r3"))
    assert problems(logged_receipts) == ["receipt r3 (leaf 3): the row it names was deleted"]


def test_swapped_receipts_are_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        one, two = session.get(Receipt, "r1"), session.get(Receipt, "r5")
        one.body, two.body = two.body, one.body
    found = problems(logged_receipts)
    assert any("r1" in p for p in found) and any("r5" in p for p in found)


def test_rewritten_log_fails_against_published_root(logged_receipts):
    with session_scope(logged_receipts) as session:
        size, published = audit_log.root(session)
    from provenance.models import AuditLeaf

    with session_scope(logged_receipts, write=True) as session:
        # Swap two whole leaves: each still matches its receipt, only the order changed.
        a, b = session.get(AuditLeaf, 0), session.get(AuditLeaf, 1)
        fields = ("kind", "ref", "tenant_id", "payload", "leaf_hash")
        saved = {f: getattr(a, f) for f in fields}
        for f in fields:
            setattr(a, f, getattr(b, f))
            setattr(b, f, saved[f])
    assert problems(logged_receipts) == []
    assert problems(logged_receipts, (size, published.hex())) == [
        "the first 6 leaves no longer hash to the published root: the log was rewritten"
    ]


def test_cli_verify_names_the_row(logged_receipts, monkeypatch, tmp_path):
    monkeypatch.setenv("INHERENT_DATABASE_URL", logged_receipts)
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    from provenance.settings import get_settings

    get_settings.cache_clear()
    runner = CliRunner()
    result = runner.invoke(app, ["audit", "root"])
    assert result.exit_code == 0 and json.loads(result.stdout)["tree_size"] == 6
    assert runner.invoke(app, ["audit", "verify"]).exit_code == 0
    with session_scope(logged_receipts, write=True) as session:
        # Only an indexed column, the body untouched: still caught.
        session.execute(update(Receipt).where(Receipt.id == "r0").values(output_hash="forged"))
    result = runner.invoke(app, ["audit", "verify"])
    assert result.exit_code == 1 and "receipt r0" in result.stderr
    get_settings.cache_clear()
