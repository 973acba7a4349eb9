"""Both vector index backends: visibility at a snapshot, exact search, a total order, upkeep."""

import json
import uuid

import numpy as np
import pytest
from qdrant_client import QdrantClient

from provenance.hashing import blake3_hex
from provenance.models import OPEN_EPOCH
from provenance.vector_index import EdgeIndex, IndexHit, IndexPoint, QdrantClientIndex, exact_top
from tests.ingest_support import BACKENDS, DIM, make_index


def point(
    source: str,
    version: int,
    ordinal: int,
    vf: int,
    vt: int = OPEN_EPOCH,
    *,
    vector=None,
    tenant: str = "t",
    chunk_hash: str | None = None,
    seed: int = 0,
) -> IndexPoint:
    name = f"{tenant}/{source}/{version}/{ordinal}"
    chunk_hash = chunk_hash or blake3_hex(name)
    if vector is None:
        vector = np.random.default_rng(int(chunk_hash[:8], 16) + seed).standard_normal(DIM)
    return IndexPoint(
        chunk_id=str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
        tenant_id=tenant,
        source_id=source,
        version=version,
        chunk_hash=chunk_hash,
        valid_from=vf,
        valid_to=vt,
        vector=np.asarray(vector, dtype=np.float32) / np.linalg.norm(vector),
    )


@pytest.fixture(params=BACKENDS)
def index(request, tmp_path):
    ix = make_index(request.param, tmp_path)
    yield ix
    ix.close()


def brute_force(points, query, tenant, epoch):
    """Which points are visible at the epoch, best first by cosine (the reference answer)."""
    q = query / np.linalg.norm(query)
    visible = [p for p in points if p.tenant_id == tenant and p.valid_from <= epoch < p.valid_to]
    return sorted(visible, key=lambda p: (-float(p.vector @ q), p.chunk_hash))


def test_upsert_scan_count_round_trip(index):
    points = [point("a", 1, i, 1) for i in range(5)] + [point("b", 1, 0, 2, tenant="other")]
    index.upsert(points)
    assert index.count() == 6
    assert index.count("t") == 5
    scanned = {p.chunk_id: p for p in index.scan("t")}
    assert set(scanned) == {p.chunk_id for p in points[:5]}
    for p in points[:5]:
        assert scanned[p.chunk_id].same_payload(p)
        assert scanned[p.chunk_id].vector is None
    # Upserting the same ids again overwrites instead of duplicating.
    index.upsert(points)
    assert index.count() == 6


def test_search_sees_exactly_the_versions_visible_at_the_snapshot(index):
    rng = np.random.default_rng(7)
    # s1: v1 open at 1, closed at 3 by v2; s2: open at 2, deleted at 4; s3 opened at 5 (not yet
    # committed when searching at 4); another tenant everywhere.
    layout = [("s1", 1, 1, 3), ("s1", 2, 3, OPEN_EPOCH), ("s2", 1, 2, 4), ("s3", 1, 5, OPEN_EPOCH)]
    points = [
        point(s, v, i, vf, vt, vector=rng.standard_normal(DIM))
        for s, v, vf, vt in layout
        for i in range(4)
    ]
    points += [
        point("x", 1, i, 1, tenant="other", vector=rng.standard_normal(DIM)) for i in range(4)
    ]
    index.upsert(points)
    for s, v, _, vt in layout:
        if vt != OPEN_EPOCH:
            index.close_version("t", s, v, vt)
    query = rng.standard_normal(DIM).astype(np.float32)
    for epoch in range(0, 7):
        expected = brute_force(points, query, "t", epoch)
        hits = index.search("t", query, epoch, 100)
        assert {h.chunk_id for h in hits} == {p.chunk_id for p in expected}, f"epoch {epoch}"
        assert all(h.valid_from <= epoch < h.valid_to for h in hits)
        # The top hit agrees with brute force when scores are well separated.
        if expected:
            assert hits[0].chunk_id == expected[0].chunk_id


def test_live_fast_path_and_range_path_agree(index, monkeypatch):
    rng = np.random.default_rng(3)
    points = []
    for s in range(12):
        vf, vt = int(rng.integers(1, 6)), OPEN_EPOCH
        if s % 3 == 0:
            vt = vf + int(rng.integers(1, 4))
        points += [point(f"s{s}", 1, i, vf, vt, vector=rng.standard_normal(DIM)) for i in range(3)]
    index.upsert(points)
    for p in points:
        if p.valid_to != OPEN_EPOCH:
            index.close_version("t", p.source_id, 1, p.valid_to)
    query = rng.standard_normal(DIM).astype(np.float32)
    latest_close = max(p.valid_to for p in points if p.valid_to != OPEN_EPOCH)
    for epoch in range(latest_close, latest_close + 3):
        fast = index.search("t", query, epoch, 7)
        monkeypatch.setattr(type(index), "_latest_close", lambda self, tenant: OPEN_EPOCH)
        slow = index.search("t", query, epoch, 7)
        monkeypatch.undo()
        assert [h.chunk_id for h in fast] == [h.chunk_id for h in slow]


def test_a_close_after_a_search_is_seen_by_the_next_search(index):
    """The latest close is remembered between searches (EdgeIndex): a close must move it."""
    rng = np.random.default_rng(5)
    points = [point("s", 1, i, 1, vector=rng.standard_normal(DIM)) for i in range(3)]
    index.upsert(points)
    query = rng.standard_normal(DIM).astype(np.float32)
    assert len(index.search("t", query, 1, 10)) == 3
    index.close_version("t", "s", 1, 2)  # visible at 1, no longer live
    assert len(index.search("t", query, 1, 10)) == 3
    assert index.search("t", query, 2, 10) == []


def test_a_close_applied_during_a_search_sends_it_down_the_range_path(tmp_path, monkeypatch):
    """A close that lands while the live set is queried hides points visible at the snapshot
    from that query; the search must notice and answer from the range filter."""
    index = make_index("edge", tmp_path)
    rng = np.random.default_rng(6)
    points = [point("s", 1, i, 1, vector=rng.standard_normal(DIM)) for i in range(3)]
    index.upsert(points)
    query = rng.standard_normal(DIM).astype(np.float32)
    assert len(index.search("t", query, 1, 10)) == 3  # the latest close (none) is remembered
    live_query = EdgeIndex._query

    def close_meanwhile(self, vector, tenant_id, snapshot_epoch, limit):
        if snapshot_epoch is None:  # the live fast path: a writer closes the version now
            index.close_version("t", "s", 1, 2)
        return live_query(self, vector, tenant_id, snapshot_epoch, limit)

    monkeypatch.setattr(EdgeIndex, "_query", close_meanwhile)
    assert len(index.search("t", query, 1, 10)) == 3
    index.close()


def test_ties_are_broken_by_chunk_hash_even_across_the_limit(index):
    same = np.ones(DIM, dtype=np.float32)
    hashes = [f"{i:064x}" for i in range(20)]
    order = [7, 3, 19, 0, 11, 5, 14, 2, 9, 16, 1, 18, 4, 12, 6, 17, 8, 13, 10, 15]
    index.upsert([point("dup", 1, i, 1, vector=same, chunk_hash=hashes[i]) for i in order])
    hits = index.search("t", same, 1, 5)
    assert [h.chunk_hash for h in hits] == hashes[:5]
    assert len({h.score for h in hits}) == 1


def test_hits_come_in_a_total_order(index):
    rng = np.random.default_rng(11)
    base = rng.standard_normal(DIM)
    # Pairs of identical vectors: equal scores, so the chunk hash decides.
    points = []
    for i in range(10):
        v = base + rng.standard_normal(DIM) * 0.5
        points.append(point("p", 1, 2 * i, 1, vector=v, chunk_hash=f"{2 * i + 1:064x}"))
        points.append(point("p", 1, 2 * i + 1, 1, vector=v, chunk_hash=f"{2 * i:064x}"))
    index.upsert(points)
    hits = index.search("t", base.astype(np.float32), 1, 20)
    keys = [(-h.score, h.chunk_hash) for h in hits]
    assert keys == sorted(keys)
    again = index.search("t", base.astype(np.float32), 1, 20)
    assert [h.chunk_id for h in again] == [h.chunk_id for h in hits]
    # qdrant-client's local mode scores through numpy, whose last bit can vary between calls.
    np.testing.assert_allclose([h.score for h in again], [h.score for h in hits], rtol=1e-6)


def test_close_version_delete_and_payload_repair(index):
    v1 = [point("a", 1, i, 1) for i in range(3)]
    index.upsert(v1)
    index.close_version("t", "a", 1, 2)
    assert {p.valid_to for p in index.scan("t")} == {2}
    assert index.search("t", v1[0].vector, 2, 10) == []
    assert len(index.search("t", v1[0].vector, 1, 10)) == 3
    index.set_payloads([v1[0]])  # back to open, as SQL would say
    assert [h.chunk_id for h in index.search("t", v1[0].vector, 5, 10)] == [v1[0].chunk_id]
    index.delete([p.chunk_id for p in v1[1:]])
    assert index.count("t") == 1


def test_a_search_over_nothing_returns_nothing(index):
    assert index.search("nobody", np.ones(DIM, dtype=np.float32), 3, 4) == []
    assert index.search("t", np.ones(DIM, dtype=np.float32), 3, 0) == []


def test_edge_index_persists_across_reopen(tmp_path):
    points = [point("a", 1, i, 1) for i in range(4)]
    index = EdgeIndex(tmp_path / "edge", DIM)
    index.upsert(points)
    index.close_version("t", "a", 1, 3)
    index.flush()
    index.close()
    reopened = EdgeIndex(tmp_path / "edge", DIM)
    try:
        assert reopened.count("t") == 4
        assert {p.valid_to for p in reopened.scan("t")} == {3}
        assert reopened._latest_close("t") == 3
    finally:
        reopened.close()


def test_client_index_refuses_a_collection_of_another_dimension():
    client = QdrantClient(location=":memory:")
    QdrantClientIndex(client, "c", DIM)
    with pytest.raises(ValueError, match="dimensional"):
        QdrantClientIndex(client, "c", DIM * 2)


def test_exact_top_fetches_more_while_the_cut_is_tied():
    scores = [0.9, 0.5, 0.5, 0.5, 0.5, 0.1]
    pool = [
        IndexHit(str(i), s, f"{(10 - i):064x}", 1, OPEN_EPOCH) for i, s in enumerate(scores)
    ]
    fetched = []

    def query(n):
        fetched.append(n)
        return pool[:n]

    top = exact_top(query, 2, keep=lambda h: True)
    # The smallest hash among the four tied 0.5s wins, which needs all of them fetched.
    assert [h.chunk_id for h in top] == ["0", "4"]
    assert fetched[-1] >= 5


def test_edge_index_refuses_a_shard_of_another_dimension_and_keeps_its_storage_type(tmp_path):
    EdgeIndex(tmp_path / "edge", DIM, datatype="float32").close()
    with pytest.raises(ValueError, match="dimensional"):
        EdgeIndex(tmp_path / "edge", DIM * 2)
    reopened = EdgeIndex(tmp_path / "edge", DIM)  # float16 by default; the shard stays float32
    reopened.upsert([point("a", 1, 0, 1)])
    assert reopened.count() == 1
    reopened.close()


def test_edge_index_search_pool_is_set_at_every_open_and_the_layout_kept(tmp_path):
    path = tmp_path / "edge"
    points = [point("a", 1, i, 1) for i in range(6)]
    query = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
    created = EdgeIndex(path, DIM, datatype="float32", search_threads=3)
    created.upsert(points)
    created.flush()
    expected = created.search("t", query, 1, 4)
    created.close()

    def stored() -> dict:
        return json.loads((path / "edge_config.json").read_text())

    assert stored()["max_search_threads"] == 3
    reopened = EdgeIndex(path, DIM)  # one search thread; the float32 shard stays float32
    try:
        assert stored()["max_search_threads"] == 1
        assert stored()["vectors"][""] == {"size": DIM, "distance": "Cosine"}
        assert stored()["hnsw_config"]["m"] == 0
        assert reopened.search("t", query, 1, 4) == expected
        assert [h.chunk_id for h in expected] == [
            p.chunk_id for p in brute_force(points, query, "t", 1)[:4]
        ]
    finally:
        reopened.close()
