"""The truth layer: versions as MVCC over epochs, the write order, crash recovery and the sweep."""

import threading
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy import func, select, update

from provenance import memory, truth
from provenance.models import (
    OPEN_EPOCH,
    AuditLeaf,
    Chunk,
    Epoch,
    EpochCounter,
    SourceVersion,
)
from provenance.truth import content_hash
from provenance.vector_index import IndexHit
from tests.ingest_support import (
    BACKENDS,
    draft,
    make_index,
    migrated_sessions,
    vector_for,
    vectors_of,
)


class Crash(RuntimeError):
    """Stands for the process dying at one point of the write path."""


class CrashingIndex:
    """Passes every call through to a real index, but dies at the named method."""

    def __init__(self, inner, crash_at: str, before: bool = True):
        self.inner, self.crash_at, self.before = inner, crash_at, before

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name != self.crash_at:
            return method

        def crash(*args, **kwargs):
            if not self.before:
                method(*args, **kwargs)
            raise Crash(name)

        return crash


class TextEmbedder:
    """Query vectors for memory.retrieve: a chunk's own text finds that chunk first."""

    model_id = "test-vectors"
    dim = 16

    def embed(self, texts):
        return np.stack([vector_for(content_hash(t)) for t in texts])


@pytest.fixture
def sessions(sqlite_url):
    return migrated_sessions(sqlite_url)


@pytest.fixture(params=BACKENDS)
def index(request, tmp_path):
    ix = make_index(request.param, tmp_path)
    yield ix
    ix.close()


def commit(sessions, index, *drafts, closes=(), tenant="acme"):
    return truth.commit(
        sessions, index, tenant, upserts=drafts, closes=closes, vectors=vectors_of(*drafts)
    )


def versions(sessions, source_id, tenant="acme"):
    with sessions() as s:
        return truth.list_versions(s, tenant, source_id)


def current(sessions, tenant="acme"):
    with sessions() as s:
        return truth.current_epoch(s, tenant)


def test_a_new_source_opens_version_1_in_epoch_1(sessions, index):
    doc = draft("guide.md", ["Llamas hum.", "Alpacas spit."], title="Guide")
    result = commit(sessions, index, doc)
    assert (result.epoch, result.added, result.points_written) == (1, ["guide.md"], 2)
    [v1] = versions(sessions, "guide.md")
    assert (v1.version, v1.valid_from, v1.valid_to, v1.status, v1.title) == (
        1,
        1,
        OPEN_EPOCH,
        "active",
        "Guide",
    )
    assert v1.content_hash == doc.content_hash
    with sessions() as s:
        chunks = truth.chunks_as_of(s, "acme", 1)
        leaves = s.scalars(select(AuditLeaf.kind)).all()
    assert [c.id for c in chunks] == [truth.chunk_id("acme", "guide.md", 1, i) for i in range(2)]
    assert [c.chunk_hash for c in chunks] == [
        content_hash("Llamas hum."),
        content_hash("Alpacas spit."),
    ]
    assert leaves == ["version_opened"]
    assert index.count("acme") == 2


def test_identical_content_is_a_no_op_that_takes_no_epoch(sessions, index):
    doc = draft("a", ["same text"])
    commit(sessions, index, doc)
    again = commit(sessions, index, doc)
    assert again.epoch is None and again.unchanged == ["a"]
    assert current(sessions) == 1
    assert len(versions(sessions, "a")) == 1
    assert index.count("acme") == 1


def test_changed_content_closes_the_old_version_and_opens_a_new_one_in_one_epoch(sessions, index):
    commit(sessions, index, draft("a", ["one", "two"]), draft("b", ["bee"]))
    result = commit(sessions, index, draft("a", ["one", "two changed"]), draft("b", ["bee"]))
    assert (result.epoch, result.updated, result.unchanged) == (2, ["a"], ["b"])
    v1, v2 = versions(sessions, "a")
    assert (v1.status, v1.valid_from, v1.valid_to) == ("superseded", 1, 2)
    assert (v2.status, v2.valid_from, v2.valid_to) == ("active", 2, OPEN_EPOCH)
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Epoch)) == 2
        assert s.scalars(select(AuditLeaf.kind).order_by(AuditLeaf.seq)).all() == [
            "version_opened",
            "version_opened",
            "version_closed",
            "version_opened",
        ]
    # The index followed: the old version's points carry valid_to = 2.
    old = {p.valid_to for p in index.scan("acme") if p.source_id == "a" and p.version == 1}
    assert old == {2}


def test_as_of_an_epoch_or_a_time_reconstructs_what_was_visible(sessions, index):
    commit(sessions, index, draft("a", ["alpha"]), draft("b", ["beta"]))
    with sessions() as s:
        after_first = s.scalar(select(Epoch.committed_at).where(Epoch.epoch == 1))
    commit(sessions, index, draft("a", ["alpha two"]))
    commit(sessions, index, closes=[("b", "deleted")])
    with sessions() as s:
        at = {
            e: [(v.source_id, v.version) for v in truth.as_of(s, "acme", epoch=e).versions]
            for e in range(4)
        }
        assert at == {0: [], 1: [("a", 1), ("b", 1)], 2: [("a", 2), ("b", 1)], 3: [("a", 2)]}
        assert truth.as_of(s, "acme").epoch == 3
        by_time = truth.as_of(s, "acme", at=after_first + timedelta(microseconds=1))
        assert by_time.epoch == 1 and [v.source_id for v in by_time.versions] == ["a", "b"]
        assert truth.as_of(s, "acme", at=datetime(2000, 1, 1, tzinfo=UTC)).versions == ()
        assert [c.text for c in truth.chunks_as_of(s, "acme", 1)] == ["alpha", "beta"]
        assert [c.text for c in truth.chunks_as_of(s, "acme", 3)] == ["alpha two"]


def test_deprecate_and_delete_leave_tombstones_and_keep_history(sessions, index):
    commit(sessions, index, draft("a", ["aaa"]), draft("b", ["bbb"]))
    deprecated = truth.close_source(sessions, index, "acme", "a", "deprecated")
    deleted = truth.close_source(sessions, index, "acme", "b", "deleted")
    assert (deprecated.epoch, deprecated.deprecated) == (2, ["a"])
    assert (deleted.epoch, deleted.deleted) == (3, ["b"])
    assert [(v.status, v.valid_to) for v in versions(sessions, "a")] == [("deprecated", 2)]
    assert [(v.status, v.valid_to) for v in versions(sessions, "b")] == [("deleted", 3)]
    # Closing what is already closed changes nothing and takes no epoch.
    assert truth.close_source(sessions, index, "acme", "a", "deleted").epoch is None
    with sessions() as s:
        assert [v.source_id for v in truth.as_of(s, "acme", epoch=2).versions] == ["b"]
        assert truth.as_of(s, "acme", epoch=3).versions == ()
        assert len(truth.chunks_as_of(s, "acme", 1)) == 2  # history stays replayable
        assert {x.source_id: x.status for x in truth.list_sources(s, "acme")} == {
            "a": "deprecated",
            "b": "deleted",
        }
    # The same content again after a delete is visible again, as a new version.
    again = commit(sessions, index, draft("b", ["bbb"]))
    assert again.added == ["b"] and [v.version for v in versions(sessions, "b")] == [1, 2]
    with pytest.raises(ValueError):
        truth.close_source(sessions, index, "acme", "a", "superseded")
    with pytest.raises(ValueError, match="at most once"):
        commit(sessions, index, draft("c", ["x"]), draft("c", ["y"]))


def test_get_chunks_returns_text_and_hashes_in_the_order_asked(sessions, index):
    commit(sessions, index, draft("a", ["first", "second"]), draft("b", ["third"]))
    ids = [truth.chunk_id("acme", "b", 1, 0), "no-such-id", truth.chunk_id("acme", "a", 1, 1)]
    with sessions() as s:
        found = truth.get_chunks(s, "acme", ids)
        assert truth.get_chunks(s, "other-tenant", ids) == []
    assert [(c.text, c.chunk_hash) for c in found] == [
        ("third", content_hash("third")),
        ("second", content_hash("second")),
    ]


def run_concurrent_writers(sessions, index, writers: int) -> list[int]:
    epochs, errors = [], []
    start = threading.Barrier(writers)

    def write(n: int) -> None:
        try:
            start.wait()
            result = commit(sessions, index, draft(f"src-{n}", [f"text of writer {n}"]))
            epochs.append(result.epoch)
        except Exception as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return sorted(epochs)


def test_concurrent_writers_get_distinct_consecutive_epochs_on_sqlite(sessions, tmp_path):
    index = make_index("edge", tmp_path)
    assert run_concurrent_writers(sessions, index, 8) == list(range(1, 9))
    assert index.count("acme") == 8


@pytest.mark.integration
def test_concurrent_writers_get_distinct_consecutive_epochs_on_postgresql(pg_url, tmp_path):
    sessions = migrated_sessions(pg_url)
    index = make_index("edge", tmp_path)
    assert run_concurrent_writers(sessions, index, 8) == list(range(1, 9))
    with sessions() as s:
        assert s.scalars(select(Epoch.epoch).order_by(Epoch.epoch)).all() == list(range(1, 9))


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_the_visibility_check_drops_another_tenants_chunk_that_the_index_returns(
    database, request, tmp_path
):
    """The re-check looks chunks up by id (the tenant is checked on the rows): a hit that names
    another tenant's chunk, from a stale or damaged index, never reaches the prompt. It reads
    the chunk as the ORM would, on either database, whatever the number of ids."""
    url = request.getfixturevalue("sqlite_url" if database == "sqlite" else "pg_url")
    sessions, index = migrated_sessions(url), make_index("edge", tmp_path)
    commit(sessions, index, draft("a", ["acme's own words", "and more of them"], title="A"))
    commit(sessions, index, draft("b", ["beta's secret words"]), tenant="beta")
    ours = [truth.chunk_id("acme", "a", 1, i) for i in range(2)]
    theirs = truth.chunk_id("beta", "b", 1, 0)
    with sessions() as s:
        rows = memory.visible_chunks(s, "acme", 1, [ours[0], theirs])
        assert [row.id for row in rows] == [ours[0]]
        assert memory.visible_chunks(s, "beta", 1, [ours[0]]) == []
        both = sorted(memory.visible_chunks(s, "acme", 1, [*ours, theirs, "unknown"]))
        for row, chunk_id in zip(both, sorted(ours), strict=True):
            chunk = s.get(Chunk, chunk_id)
            assert row.version_title == "A"
            for column in ["id", "tenant_id", "source_id", "version", "ordinal", "text",
                           "chunk_hash", "char_start", "char_end"]:
                assert getattr(row, column) == getattr(chunk, column), column
        assert memory.visible_chunks(s, "acme", 0, ours) == []  # before the version's epoch
    index.close()


def test_the_visibility_cache_answers_as_sql_did_and_asks_only_about_new_ids(
    sessions, index, monkeypatch
):
    commit(sessions, index, draft("a", ["acme's own words", "and more of them"], title="A"))
    commit(sessions, index, draft("b", ["beta's secret words"]), tenant="beta")
    commit(sessions, index, draft("a", ["acme's second draft"], title="A2"))  # epoch 2: v1 closed
    ours = [truth.chunk_id("acme", "a", 1, i) for i in range(2)]
    newer = truth.chunk_id("acme", "a", 2, 0)
    theirs = truth.chunk_id("beta", "b", 1, 0)
    asked: list[list[str]] = []
    real = memory.visible_chunks

    def counted(session, tenant_id, epoch, chunk_ids):
        asked.append(list(chunk_ids))
        return real(session, tenant_id, epoch, chunk_ids)

    monkeypatch.setattr(memory, "visible_chunks", counted)
    cache = memory.VisibilityCache(max_entries=5)
    ids = [*ours, newer, theirs, "unknown"]
    with sessions() as s:
        for epoch in (1, 2):
            expected = sorted(real(s, "acme", epoch, ids))
            assert expected and sorted(cache.visible_chunks(s, "acme", epoch, ids)) == expected
            # Known ids never reach the session (None here)
            assert sorted(cache.visible_chunks(None, "acme", epoch, ids[::-1])) == expected
        assert [row.id for row in cache.visible_chunks(None, "acme", 2, ids)] == [newer]
        # Five entries kept: epoch 1's were the least recently used, and are asked again.
        assert [row.id for row in cache.visible_chunks(s, "acme", 1, ours)] == ours
        assert asked == [ids, ids, ours]
        assert [row.id for row in cache.visible_chunks(s, "beta", 1, [theirs, ours[0]])] == [theirs]


class ListedIndex:
    """An index that returns the best ``limit`` of fixed hits, as a real one orders them."""

    def __init__(self, hits: list[IndexHit]):
        self.hits, self.limits = sorted(hits, key=lambda h: h.order_key), []

    def search(self, tenant_id, vector, snapshot_epoch, limit):
        self.limits.append(limit)
        return self.hits[:limit]


class ListedVisibility:
    """SQL's answer for every id but ``hidden``; records the ids each look-up asked about."""

    def __init__(self, hidden: set[str]):
        self.hidden, self.asked = hidden, []

    def visible_chunks(self, session, tenant_id, epoch, chunk_ids):
        self.asked.append(list(chunk_ids))
        return [
            memory.VisibleChunk(i, tenant_id, "doc", 1, 0, i, f"hash-{i}", 0, 1, "Doc")
            for i in chunk_ids if i not in self.hidden
        ]


def listed_retrieve(hits, hidden, top_k, min_score=-1.0):
    index, visibility = ListedIndex(hits), ListedVisibility(hidden)
    found = memory.retrieve(None, SimpleNamespace(model_id="m"), index, "q", "acme", 1, top_k,
                            np.zeros(2, np.float32), min_score, visibility)
    return [c.chunk_id for c in found.chunks], index.limits, visibility.asked


def test_retrieval_reads_one_hit_past_the_cut_and_widens_past_hits_sql_hides():
    hits = [
        IndexHit(f"c{i:02d}", 0.9 - i / 100, f"hash-c{i:02d}", 1, OPEN_EPOCH) for i in range(30)
    ]
    # The common case: top_k + 1 hits read, as many ids looked up.
    chunks, limits, asked = listed_retrieve(hits, set(), 4)
    assert (chunks, limits, [len(a) for a in asked]) == (["c00", "c01", "c02", "c03"], [5], [5])
    # An index behind SQL shows ten hits SQL has hidden: still four chunks, the next best.
    hidden = {f"c{i:02d}" for i in range(10)}
    chunks, limits, _ = listed_retrieve(hits, hidden, 4)
    assert (chunks, limits) == (["c10", "c11", "c12", "c13"], [5, 10, 20])
    # Fewer chunks than asked where the index runs out, or the similarity floor cuts it.
    assert listed_retrieve(hits[:3], set(), 4)[:2] == (["c00", "c01", "c02"], [5])
    assert listed_retrieve(hits, set(), 4, min_score=0.885)[:2] == (["c00", "c01"], [5])


def test_retrieval_breaks_a_tie_of_rounded_scores_at_the_cut_by_chunk_hash():
    """Three scores that differ below the sixth decimal rank as one: the chunk hash orders them,
    whichever the index put first, so the search goes on past the hit after the cut."""
    tied = [IndexHit(c, s, f"hash-{c}", 1, OPEN_EPOCH)
            for c, s in [("b", 0.9000002), ("c", 0.9000001), ("a", 0.9000000)]]
    below = IndexHit("d", 0.5, "hash-d", 1, OPEN_EPOCH)
    chunks, limits, _ = listed_retrieve([*tied, below], set(), 1)
    assert (chunks, limits) == (["a"], [2, 4])


def retrieve(sessions, index, query, epoch=None, top_k=10):
    with sessions() as s:
        epoch = truth.current_epoch(s, "acme") if epoch is None else epoch
        found = memory.retrieve(s, TextEmbedder(), index, query, "acme", epoch, top_k)
    return [(c.source_id, c.version, c.text) for c in found.chunks]


def test_a_crash_before_the_sql_commit_leaves_nothing_visible_and_a_rerun_converges(
    sessions, index
):
    v1 = draft("a", ["kept paragraph", "old ending"])
    commit(sessions, index, v1)
    v2 = draft("a", ["kept paragraph", "new ending", "and more"])
    with pytest.raises(Crash):
        commit(sessions, CrashingIndex(index, "flush"), v2)  # vectors written, SQL never committed
    assert current(sessions) == 1
    assert [v.version for v in versions(sessions, "a")] == [1]
    assert index.count("acme") == 5  # three orphans wait in the index...
    assert {r[1] for r in retrieve(sessions, index, "new ending")} == {
        1
    }  # ...but are never retrieved

    # Re-running writes the same chunk ids at the same epoch: no duplicates.
    result = commit(sessions, index, v2)
    assert result.epoch == 2
    assert index.count("acme") == 5
    report = truth.sweep(sessions, index, "acme")
    assert (report.orphans_deleted, report.payloads_repaired, report.points_missing) == (0, 0, 0)
    assert retrieve(sessions, index, "new ending")[0] == ("a", 2, "new ending")


def test_orphans_of_a_crashed_commit_are_swept_when_the_rerun_writes_fewer_chunks(sessions, index):
    commit(sessions, index, draft("a", ["start"]))
    with pytest.raises(Crash):
        commit(sessions, CrashingIndex(index, "flush"), draft("a", ["x", "y", "z"]))
    commit(sessions, index, draft("a", ["only one"]))
    assert index.count("acme") == 4  # v1, the new v2, and two orphans of the crashed v2
    report = truth.sweep(sessions, index, "acme")
    assert report.orphans_deleted == 2
    with sessions() as s:
        assert {p.chunk_id for p in index.scan("acme")} == set(truth.expected_points(s, "acme"))


def test_a_crash_after_the_sql_commit_never_shows_half_a_version(sessions, index):
    commit(sessions, index, draft("a", ["shared intro", "old detail one", "old detail two"]))
    v2 = draft("a", ["shared intro", "new detail"])
    with pytest.raises(Crash):
        commit(sessions, CrashingIndex(index, "close_version"), v2)  # SQL committed, index not told
    assert current(sessions) == 2
    stale = [p for p in index.scan("acme") if p.version == 1]
    assert {p.valid_to for p in stale} == {OPEN_EPOCH}  # the index still calls v1 open
    for query in ["old detail one", "new detail", "shared intro"]:
        now = retrieve(sessions, index, query)
        assert {version for _, version, _ in now} == {2}, query
        before = retrieve(sessions, index, query, epoch=1)
        assert {version for _, version, _ in before} == {1}, query

    report = truth.sweep(sessions, index, "acme")
    assert report.payloads_repaired == 3 and report.orphans_deleted == 0
    assert {p.valid_to for p in index.scan("acme") if p.version == 1} == {2}
    version_of = {p.chunk_id: p.version for p in index.scan("acme")}
    hits = index.search("acme", vector_for(content_hash("old detail one")), 2, 10)
    assert {version_of[h.chunk_id] for h in hits} == {2}


def test_sweep_restores_missing_points_from_the_embedding_cache(sessions, index):
    doc = draft("a", ["one", "two"])
    commit(sessions, index, doc)
    with sessions() as s, s.begin():
        truth.store_vectors(s, "m", vectors_of(doc))
    lost = truth.chunk_id("acme", "a", 1, 1)
    index.delete([lost])
    assert truth.sweep(sessions, index, "acme").points_missing == 1  # no model: reported only
    report = truth.sweep(sessions, index, "acme", model_id="m")
    assert report.points_restored == 1 and report.points_missing == 0
    [hit] = index.search("acme", vector_for(content_hash("two")), 1, 1)
    assert hit.chunk_id == lost


def test_epochs_count_per_tenant(sessions, index):
    commit(sessions, index, draft("a", ["x"]))
    commit(sessions, index, draft("a", ["y"]))
    assert commit(sessions, index, draft("a", ["z"]), tenant="beta").epoch == 1
    assert (current(sessions), current(sessions, "beta"), current(sessions, "nobody")) == (2, 1, 0)
    with sessions() as s:
        assert [v.version for v in truth.as_of(s, "acme", epoch=1).versions] == [1]
        assert [v.version for v in truth.as_of(s, "beta").versions] == [1]
        assert s.scalars(select(EpochCounter.value).order_by(EpochCounter.tenant_id)).all() == [2, 1]


@pytest.mark.integration
def test_writers_of_different_tenants_do_not_wait_for_each_other_on_postgresql(pg_url, tmp_path):
    sessions = migrated_sessions(pg_url)
    index = make_index("edge", tmp_path)
    commit(sessions, index, draft("a", ["x"]))
    holder = sessions()
    holder.execute(
        update(EpochCounter).where(EpochCounter.tenant_id == "acme").values(value=EpochCounter.value)
    )  # acme's writers' lock, held open
    try:
        other = threading.Thread(target=commit, args=(sessions, index, draft("b", ["y"])), kwargs={"tenant": "beta"})
        other.start()
        other.join(timeout=20)
        assert not other.is_alive(), "beta's commit waited for acme's writers' lock"
        same = threading.Thread(target=commit, args=(sessions, index, draft("c", ["z"])))
        same.start()
        same.join(timeout=1)
        assert same.is_alive(), "acme's second writer did not wait for the lock"
    finally:
        holder.rollback()
        holder.close()
    same.join(timeout=20)
    assert (current(sessions), current(sessions, "beta")) == (2, 1)


def test_sql_rows_match_the_points_after_a_run_of_changes(sessions, index):
    commit(sessions, index, draft("a", ["1", "2"]), draft("b", ["3"]))
    commit(sessions, index, draft("a", ["1", "2b"]), draft("c", ["4"]))
    truth.close_source(sessions, index, "acme", "b", "deleted")
    with sessions() as s:
        expected = truth.expected_points(s, "acme")
        assert s.scalar(select(func.count()).select_from(Chunk)) == len(expected) == 6
        assert s.scalar(select(func.count()).select_from(SourceVersion)) == 4
    scanned = {p.chunk_id: p for p in index.scan("acme")}
    assert set(scanned) == set(expected)
    assert all(scanned[c].same_payload(p) for c, p in expected.items())


class WritingIndex:
    """A real index whose upsert and scan first commit a write to the SQLite store through a
    connection of their own that gives up after 0.2 s: it succeeds only if no transaction of
    the truth layer holds the database write lock across the vector work."""

    def __init__(self, inner, database: str):
        self.inner, self.database = inner, database
        self.writes: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _write(self, what: str) -> None:
        import sqlite3

        connection = sqlite3.connect(self.database, timeout=0.2, isolation_level=None)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO tenants (id, name, created_at) VALUES (?, ?, ?)",
                (f"probe-{len(self.writes)}", what, "2026-01-01 00:00:00"),
            )
            connection.execute("COMMIT")
        finally:
            connection.close()
        self.writes.append(what)

    def upsert(self, points):
        self._write("upsert")
        return self.inner.upsert(points)

    def scan(self, tenant_id=None):
        self._write("scan")
        return self.inner.scan(tenant_id)


def test_no_sqlite_write_lock_is_held_across_the_vector_upsert_or_the_sweep_scan(
    sqlite_url, tmp_path
):
    sessions = migrated_sessions(sqlite_url)
    index = WritingIndex(make_index("edge", tmp_path), sqlite_url.removeprefix("sqlite:///"))
    commit(sessions, index, draft("a", ["one", "two"]))
    commit(sessions, index, draft("a", ["one", "three"]), draft("b", ["bee"]))
    report = truth.sweep(sessions, index, "acme")
    assert index.writes == ["upsert", "upsert", "scan", "upsert"]  # the sweep's (empty) restore
    assert (report.orphans_deleted, report.payloads_repaired) == (0, 0)
    assert current(sessions) == 2
    assert [v.version for v in versions(sessions, "a")] == [1, 2]


def test_the_writers_lock_excludes_a_second_writer_until_the_first_commits(sqlite_url, tmp_path):
    """Two threads, one SQLite store: while one commit sits between its vector upsert and its
    SQL commit (holding no transaction), the other waits on the writers' lock, so epochs stay
    consecutive and each points' valid_from names its own epoch."""
    sessions = migrated_sessions(sqlite_url)
    inner = make_index("edge", tmp_path)
    entered, release = threading.Event(), threading.Event()

    class SlowIndex:
        def __getattr__(self, name):
            return getattr(inner, name)

        def upsert(self, points):
            inner.upsert(points)
            if points and points[0].source_id == "first":
                entered.set()
                release.wait(10)

    results = {}
    first = threading.Thread(
        target=lambda: results.setdefault("first", commit(sessions, SlowIndex(), draft("first", ["x"])))
    )
    first.start()
    assert entered.wait(10)
    second = threading.Thread(
        target=lambda: results.setdefault("second", commit(sessions, SlowIndex(), draft("second", ["y"])))
    )
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting on the writers' lock, not on SQLite
    assert current(sessions) == 0
    release.set()
    first.join(10)
    second.join(10)
    assert (results["first"].epoch, results["second"].epoch) == (1, 2)
    assert {p.source_id: p.valid_from for p in inner.scan("acme")} == {"first": 1, "second": 2}


def test_epoch_at_a_time_with_a_utc_offset_means_the_same_instant(sessions, index):
    commit(sessions, index, draft("a", ["alpha"]))
    with sessions() as s:
        committed = s.scalar(select(Epoch.committed_at).where(Epoch.epoch == 1))
    committed = committed.replace(tzinfo=UTC) if committed.tzinfo is None else committed
    plus_five = timezone(timedelta(hours=5))
    with sessions() as s:
        assert truth.epoch_at(s, "acme", (committed + timedelta(seconds=1)).astimezone(plus_five)) == 1
        assert truth.epoch_at(s, "acme", (committed - timedelta(seconds=1)).astimezone(plus_five)) == 0
