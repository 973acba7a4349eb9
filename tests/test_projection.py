"""A replica's embedded index caught up from the truth layer alone gives the same retrieval as
the writer's index, at the current epoch and at pinned snapshots, tenant by tenant."""

import numpy as np
import pytest

from provenance import truth
from provenance.projection import CaughtUpSearch, IndexProjection
from provenance.truth import SessionFactory, SourceDraft
from provenance.vector_index import EdgeIndex
from tests.ingest_support import DIM, draft, migrated_sessions, vector_for, vectors_of

MODEL = "test-embedder"


def cache_vectors(sessions: SessionFactory, *drafts: SourceDraft) -> dict[str, np.ndarray]:
    """What ingestion does before it commits: the vectors go to the embeddings cache."""
    vectors = vectors_of(*drafts)
    with sessions() as session, session.begin():
        truth.store_vectors(session, MODEL, vectors)
    return vectors


def write(sessions, writer, tenant, *drafts, closes=()):
    """A worker's commit: SQL plus the worker's own index."""
    vectors = cache_vectors(sessions, *drafts)
    return truth.commit(sessions, writer, tenant, upserts=drafts, closes=closes, vectors=vectors)


def hits(index, tenant, query, epoch):
    return [(h.chunk_id, h.score, h.valid_from, h.valid_to) for h in index.search(tenant, query, epoch, 10)]


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = request.getfixturevalue("sqlite_url")
    return migrated_sessions(url)


def test_replica_catches_up_to_every_epoch_and_matches_the_writer(sessions, tmp_path):
    writer = EdgeIndex(tmp_path / "worker", DIM)
    replica = EdgeIndex(tmp_path / "api", DIM)
    projection = IndexProjection(sessions, replica, MODEL, tmp_path / "api.applied.json")
    search = CaughtUpSearch(projection)

    a1 = draft("a.md", ["alpha one", "alpha two"])
    b1 = draft("b.md", ["beta one"])
    first = write(sessions, writer, "acme", a1, b1).epoch
    a2 = draft("a.md", ["alpha one, changed"])
    second = write(sessions, writer, "acme", a2).epoch
    third = write(sessions, writer, "acme", closes=[("b.md", "deprecated")]).epoch
    assert replica.count() == 0  # nothing reached the replica's index by itself

    query = vector_for(a1.chunks[0].chunk_hash)
    for epoch in (first, second, third):
        # The first search catches the replica up; every snapshot then matches the writer.
        assert hits(search, "acme", query, epoch) == hits(writer, "acme", query, epoch)
    assert projection.applied("acme") == third
    assert replica.count("acme") == writer.count("acme") == 4
    assert {p.chunk_id: p for p in replica.scan("acme")} == {p.chunk_id: p for p in writer.scan("acme")}
    writer.close()
    replica.close()


def test_catch_up_is_per_tenant_and_survives_a_restart(sessions, tmp_path):
    writer = EdgeIndex(tmp_path / "worker", DIM)
    state = tmp_path / "api.applied.json"
    replica = EdgeIndex(tmp_path / "api", DIM)
    projection = IndexProjection(sessions, replica, MODEL, state)

    acme = write(sessions, writer, "acme", draft("a.md", ["acme text"])).epoch
    globex = write(sessions, writer, "globex", draft("g.md", ["globex text"])).epoch
    done = projection.catch_up("acme")
    assert (done.tenant_id, done.to_epoch, done.points_written) == ("acme", acme, 1)
    assert replica.count("globex") == 0  # another tenant's epochs wait for their own catch-up
    assert [d.tenant_id for d in projection.catch_up_all()] == ["globex"]
    assert projection.applied("globex") == globex
    assert projection.catch_up("acme") is None  # nothing new: one query, no writes
    replica.close()

    # A restarted replica resumes from what it applied instead of rewriting every point.
    later = write(sessions, writer, "acme", draft("a.md", ["acme text, v2"])).epoch
    reopened = IndexProjection(sessions, EdgeIndex(tmp_path / "api", DIM), MODEL, state)
    assert reopened.applied("acme") == acme
    resumed = reopened.catch_up("acme")
    assert (resumed.from_epoch, resumed.to_epoch) == (acme, later)
    assert (resumed.points_written, resumed.versions_closed) == (1, 1)
    reopened.index.close()
    writer.close()


def test_a_search_at_a_snapshot_the_index_reflects_asks_sql_nothing(sessions, tmp_path):
    writer = EdgeIndex(tmp_path / "worker", DIM)
    replica = EdgeIndex(tmp_path / "api", DIM)
    opened = []

    def counted_sessions():
        opened.append(1)
        return sessions()

    search = CaughtUpSearch(IndexProjection(counted_sessions, replica, MODEL))
    a1 = draft("a.md", ["alpha one"])
    first = write(sessions, writer, "acme", a1).epoch
    query = vector_for(a1.chunks[0].chunk_hash)
    assert hits(search, "acme", query, first) == hits(writer, "acme", query, first)
    assert len(opened) == 1  # the catch-up
    assert hits(search, "acme", query, first) == hits(writer, "acme", query, first)
    assert len(opened) == 1  # reflected already: no session, no query
    # A newer snapshot (another process committed it) is caught up before the search.
    second = write(sessions, writer, "acme", draft("a.md", ["alpha one, changed"])).epoch
    for epoch in (second, first):
        assert hits(search, "acme", query, epoch) == hits(writer, "acme", query, epoch)
    assert len(opened) == 2
    writer.close()
    replica.close()


def test_chunks_without_a_cached_vector_are_reported_not_invented(sqlite_url, tmp_path):
    sessions = migrated_sessions(sqlite_url)
    writer = EdgeIndex(tmp_path / "worker", DIM)
    replica = EdgeIndex(tmp_path / "api", DIM)
    doc = draft("a.md", ["text one", "text two"])
    # Committed with vectors the cache never saw (another embedding model, say).
    truth.commit(sessions, writer, "acme", upserts=[doc], vectors=vectors_of(doc))
    done = IndexProjection(sessions, replica, MODEL).catch_up("acme")
    assert (done.points_written, done.points_missing) == (0, 2)
    assert replica.count() == 0
    writer.close()
    replica.close()
