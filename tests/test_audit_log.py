"""The audit log is an RFC 6962 Merkle log: proofs check out under an independent verifier,
and editing, deleting or swapping receipt rows is found and named."""

import json

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from rfc6962 import h_leaf, mth, path, proof, root_from_path, roots_from_consistency
from sqlalchemy import delete, select, update
from typer.testing import CliRunner

from gateway.cli import app
from provenance import audit_log, merkle, migrate
from provenance.db import session_scope
from provenance.models import AuditHead, AuditLeaf, AuditNode, Receipt, Tenant


def test_node_numbers_are_one_to_one():
    seen = {merkle.node_number(level, index) for level in range(40) for index in range(300)}
    assert len(seen) == 40 * 300
    for level, index in [(0, 0), (1, 0), (3, 5), (20, 2**30 + 1), (62, 0)]:
        assert merkle.node_position(merkle.node_number(level, index)) == (level, index)


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
            assert audit_log.append_leaves(session, "acme", [audit_log.receipt_leaf(receipt)]) == [i]
    return sqlite_url


def problems(url: str, published=None) -> list[str]:
    with session_scope(url) as session:
        return audit_log.verify(session, published).problems


def test_intact_log_verifies_and_proves_inclusion(logged_receipts):
    assert problems(logged_receipts) == []
    with session_scope(logged_receipts) as session:
        proof = audit_log.inclusion_proof(session, "acme", "r4")
        consistency = audit_log.consistency_proof(session, "acme", 3, 6)
    path = [bytes.fromhex(h) for h in proof["audit_path"]]
    assert root_from_path(4, bytes.fromhex(proof["leaf_hash"]), path, 6).hex() == proof["root"]
    old, new = roots_from_consistency(3, 6, [bytes.fromhex(h) for h in consistency["consistency"]], bytes.fromhex(consistency["first_root"]))
    assert (old.hex(), new.hex()) == (consistency["first_root"], consistency["second_root"]) and new.hex() == proof["root"]


def test_edited_receipt_is_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        session.execute(update(Receipt).where(Receipt.id == "r2").values(body={"output": "a better story"}))
    assert problems(logged_receipts) == [
        "receipt r2 (leaf 2 of tenant acme): the row was edited after it was logged"
    ]


def test_deleted_receipt_is_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        session.execute(delete(Receipt).where(Receipt.id == "r3"))
    assert problems(logged_receipts) == [
        "receipt r3 (leaf 3 of tenant acme): the row it names was deleted"
    ]


def test_swapped_receipts_are_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        one, two = session.get(Receipt, "r1"), session.get(Receipt, "r5")
        one.body, two.body = two.body, one.body
    found = problems(logged_receipts)
    assert any("r1" in p for p in found) and any("r5" in p for p in found)


def swap_leaves(url: str, first: int, second: int) -> None:
    """Swap two whole leaves: each still matches its receipt, only the order changed."""
    with session_scope(url, write=True) as session:
        a, b = session.get(AuditLeaf, ("acme", first)), session.get(AuditLeaf, ("acme", second))
        fields = ("kind", "ref", "payload", "nonce", "leaf_hash")
        saved = {f: getattr(a, f) for f in fields}
        for f in fields:
            setattr(a, f, getattr(b, f))
            setattr(b, f, saved[f])


def rebuild_stored_tree(url: str, tenant: str) -> None:
    """What a thorough forger does after rewriting leaves: subtrees and head to match."""
    with session_scope(url, write=True) as session:
        hashes = [
            bytes.fromhex(h)
            for h in session.scalars(
                select(AuditLeaf.leaf_hash).where(AuditLeaf.tenant_id == tenant).order_by(AuditLeaf.seq)
            )
        ]
        frontier, nodes = merkle.extend([], 0, hashes)
        session.execute(delete(AuditNode).where(AuditNode.tenant_id == tenant))
        session.add_all(
            AuditNode(tenant_id=tenant, node=merkle.node_number(lv, i), hash=h.hex()) for lv, i, h in nodes
        )
        head = session.get(AuditHead, tenant)
        head.frontier = [h.hex() for h in frontier]


def test_reordered_leaves_are_named_by_the_stored_tree(logged_receipts):
    swap_leaves(logged_receipts, 0, 1)
    assert problems(logged_receipts) == [
        "tenant acme: stored subtree (level 1, index 0) does not match its leaves",
        "tenant acme: stored subtree (level 2, index 0) does not match its leaves",
        "tenant acme: the stored head (size 6) does not match the log's 6 leaves",
    ]


def test_rewritten_log_fails_against_published_root(logged_receipts):
    with session_scope(logged_receipts) as session:
        size, published = audit_log.root(session, "acme")
    swap_leaves(logged_receipts, 0, 1)
    rebuild_stored_tree(logged_receipts, "acme")
    assert problems(logged_receipts) == []
    assert problems(logged_receipts, {"acme": (size, published.hex())}) == [
        "tenant acme: the first 6 leaves no longer hash to the published root: the log was rewritten"
    ]


def test_forged_subtree_is_named(logged_receipts):
    with session_scope(logged_receipts, write=True) as session:
        session.get(AuditNode, ("acme", merkle.node_number(1, 2))).hash = "00" * 32
    assert problems(logged_receipts) == [
        "tenant acme: stored subtree (level 1, index 2) does not match its leaves"
    ]


def test_cli_verify_names_the_row(logged_receipts, monkeypatch, tmp_path):
    monkeypatch.setenv("INHERENT_DATABASE_URL", logged_receipts)
    monkeypatch.setenv("INHERENT_DATA_DIR", str(tmp_path))
    from provenance.settings import get_settings

    get_settings.cache_clear()
    runner = CliRunner()
    result = runner.invoke(app, ["audit", "root"])
    assert result.exit_code == 0 and json.loads(result.stdout)["acme"]["tree_size"] == 6
    published = f"acme:6:{json.loads(result.stdout)['acme']['root']}"
    assert runner.invoke(app, ["audit", "verify", "--root", published]).exit_code == 0
    rewritten = runner.invoke(app, ["audit", "verify", "--root", f"acme:6:{'0' * 64}"])
    assert rewritten.exit_code == 1 and "tenant acme: the first 6 leaves" in rewritten.stderr
    assert runner.invoke(app, ["audit", "verify", "--root", "6:abc"]).exit_code != 0
    with session_scope(logged_receipts, write=True) as session:
        # Only an indexed column, the body untouched: still caught.
        session.execute(update(Receipt).where(Receipt.id == "r0").values(output_hash="forged"))
    result = runner.invoke(app, ["audit", "verify"])
    assert result.exit_code == 1 and "receipt r0" in result.stderr
    get_settings.cache_clear()


def note(i: int) -> audit_log.LeafEntry:
    return audit_log.LeafEntry("note", f"n{i}", {"i": i})


def stored_leaf_hashes(session, tenant: str) -> list[bytes]:
    query = select(AuditLeaf.leaf_hash).where(AuditLeaf.tenant_id == tenant).order_by(AuditLeaf.seq)
    return [bytes.fromhex(h) for h in session.scalars(query)]


def check_stored_proofs(session, tenant: str, size: int, indexes, old_sizes) -> None:
    """Root, inclusion and consistency proofs served from stored subtrees are RFC 6962's own,
    recomputed from all the leaves, and verify independently."""
    leaves = stored_leaf_hashes(session, tenant)
    assert len(leaves) == size
    assert audit_log.root(session, tenant) == (size, mth(leaves))
    for index in indexes:
        got = audit_log.inclusion_proof(session, tenant, f"n{index}", kind="note")
        hops = [bytes.fromhex(h) for h in got["audit_path"]]
        assert (got["leaf_index"], got["tree_size"], got["root"]) == (index, size, mth(leaves).hex())
        assert hops == path(index, leaves)
        assert root_from_path(index, leaves[index], hops, size) == mth(leaves)
    for old in old_sizes:
        got = audit_log.consistency_proof(session, tenant, old, size)
        hops = [bytes.fromhex(h) for h in got["consistency"]]
        assert hops == proof(old, leaves)
        assert (got["first_root"], got["second_root"]) == (mth(leaves[:old]).hex(), mth(leaves).hex())
        assert roots_from_consistency(old, size, hops, mth(leaves[:old])) == (mth(leaves[:old]), mth(leaves))
        assert audit_log.root(session, tenant, old) == (old, mth(leaves[:old]))


def test_stored_subtree_proofs_equal_recomputed_ones_as_the_log_grows(sqlite_url):
    migrate.upgrade(sqlite_url)
    size = 0
    # Batches of every shape: single leaves, batches that cross several powers of two.
    for batch in [1, 1, 1, 2, 3, 1, 7, 16, 1, 31, 64, 5, 129, 1, 255, 3]:
        with session_scope(sqlite_url, write=True) as session:
            seqs = audit_log.append_leaves(session, "acme", [note(size + i) for i in range(batch)])
        assert seqs == list(range(size, size + batch))
        size += batch
        with session_scope(sqlite_url) as session:
            indexes = sorted({0, size // 3, size // 2, size - 1})
            olds = sorted({1, max(size // 2, 1), max(size - 1, 1), size})
            check_stored_proofs(session, "acme", size, indexes, olds)
    with session_scope(sqlite_url) as session:
        assert audit_log.verify(session).ok


@pytest.fixture(scope="module")
def grown_log(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('log') / 'log.db'}"
    migrate.upgrade(url)
    with session_scope(url, write=True) as session:
        for start in range(0, 700, 100):
            audit_log.append_leaves(session, "acme", [note(i) for i in range(start, start + 100)])
    with session_scope(url) as session:
        return url, stored_leaf_hashes(session, "acme")


@settings(deadline=None)  # database reads on a shared machine: timing is not what is tested
@given(st.integers(min_value=1, max_value=700), st.data())
def test_stored_roots_and_consistency_at_any_sizes_are_rfc6962s(grown_log, new, data):
    url, leaves = grown_log
    old = data.draw(st.integers(min_value=1, max_value=new))
    with session_scope(url) as session:
        assert audit_log.root(session, "acme", new) == (new, mth(leaves[:new]))
        got = audit_log.consistency_proof(session, "acme", old, new)
    hops = [bytes.fromhex(h) for h in got["consistency"]]
    assert hops == proof(old, leaves[:new])
    assert merkle.verify_consistency(old, new, mth(leaves[:old]), mth(leaves[:new]), hops)


def test_the_same_content_in_two_leaves_hashes_differently(sqlite_url):
    """A random nonce in each leaf: a leaf hash cannot confirm a guess of what it logs."""
    migrate.upgrade(sqlite_url)
    payload = {"content_hash": blake3(b"a guessable document").hexdigest()}
    with session_scope(sqlite_url, write=True) as session:
        audit_log.append_leaf(session, "version_opened", "same", "acme", payload)
        audit_log.append_leaf(session, "version_opened", "same", "acme", payload)
    with session_scope(sqlite_url) as session:
        first, second = session.scalars(select(AuditLeaf).order_by(AuditLeaf.seq)).all()
    assert first.nonce != second.nonce and first.leaf_hash != second.leaf_hash
    guess = audit_log.leaf_data("version_opened", "same", payload, None)
    assert h_leaf(guess).hex() not in {first.leaf_hash, second.leaf_hash}
    for leaf in (first, second):  # the stored nonce lets anyone recompute the leaf
        data = audit_log.leaf_data(leaf.kind, leaf.ref, leaf.payload, leaf.nonce)
        assert h_leaf(data).hex() == leaf.leaf_hash


def test_tenants_have_separate_trees(sqlite_url):
    migrate.upgrade(sqlite_url)
    with session_scope(sqlite_url, write=True) as session:
        assert audit_log.append_leaves(session, "acme", [note(i) for i in range(3)]) == [0, 1, 2]
        assert audit_log.append_leaves(session, "beta", [note(9)]) == [0]
    with session_scope(sqlite_url) as session:
        assert audit_log.tenants(session) == ["acme", "beta"]
        assert audit_log.root(session, "beta")[0] == 1
        assert audit_log.inclusion_proof(session, "beta", "n0", kind="note") is None
        with pytest.raises(ValueError, match="fewer than 3"):
            audit_log.consistency_proof(session, "beta", 1, 3)
        assert audit_log.verify(session).trees.keys() == {"acme", "beta"}


def test_proofs_past_the_end_of_a_log_are_refused(grown_log):
    url, _ = grown_log
    with session_scope(url) as session:
        for old, new in [(1, 701), (700, 701), (5, 1024)]:
            with pytest.raises(ValueError, match=f"holds 700 leaves, fewer than {new}"):
                audit_log.consistency_proof(session, "acme", old, new)
        with pytest.raises(ValueError, match="holds 700 leaves, fewer than 800"):
            audit_log.root(session, "acme", 800)
