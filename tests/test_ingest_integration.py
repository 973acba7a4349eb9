"""Ingestion through a real Celery worker process on Redis, with PostgreSQL as the truth store.

The worker runs the embedded Qdrant Edge index (the default) in its own data directory. An
Edge shard belongs to one process at a time, so this test never opens it while a worker runs:
it reads SQL (and job progress) while the worker works, and opens the index only after the
worker has exited. That also checks that a shard left by a SIGKILLed worker opens again (its
write-ahead log replays) and agrees with SQL.
"""

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from sqlalchemy import select

from ingest import jobs
from ingest.broker import queue_name
from ingest.chunking import Chunker, normalize_text
from ingest.embedding import bundled_model_dir, load_tokenizer
from provenance import truth
from provenance.db import get_sessionmaker
from provenance.migrate import upgrade
from provenance.models import OPEN_EPOCH, Embedding
from provenance.settings import Settings
from provenance.vector_index import EdgeIndex

pytestmark = pytest.mark.integration

REDIS_URL = os.environ.get("INHERENT_TEST_REDIS_URL", "")
REPO = Path(__file__).resolve().parents[1]
CHUNK_TOKENS, CHUNK_OVERLAP = 64, 8
VISIBILITY_TIMEOUT_S = 2.0
WORDS = [
    "llama",
    "alpaca",
    "vicuna",
    "guanaco",
    "herd",
    "wool",
    "fibre",
    "andes",
    "valley",
    "river",
    "meadow",
    "shearing",
    "breeding",
    "pasture",
    "altitude",
    "shelter",
    "fence",
    "water",
    "hay",
    "grain",
    "vet",
    "tooth",
    "hoof",
    "coat",
    "colour",
    "spring",
    "winter",
]


@pytest.fixture
def deployment(pg_url, tmp_path):
    """Settings shared by the test and its workers: a fresh PostgreSQL database, Redis, and a
    collection name of its own (which also names the Celery queue)."""
    if not REDIS_URL:
        pytest.skip("INHERENT_TEST_REDIS_URL is not set: no Redis for integration tests")
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        redis_url=REDIS_URL,
        collection=f"it_{uuid.uuid4().hex[:12]}",
        chunk_tokens=CHUNK_TOKENS,
        chunk_overlap=CHUNK_OVERLAP,
        # A killed worker's job goes back on the queue seconds later, not an hour later. (A
        # worker runs one job at a time and its loop waits while it does, so a job that runs
        # longer than this is not handed out twice while its worker lives.)
        celery_visibility_timeout=VISIBILITY_TIMEOUT_S,
    )
    upgrade(pg_url)
    yield settings
    # Leave nothing for other runs, even after a failure: this queue and its unacked messages.
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(queue_name(settings))
    for tag in unacked_tags(client, settings):
        client.hdel("unacked", tag)
        client.zrem("unacked_index", tag)


def unacked_tags(client: redis.Redis, settings: Settings) -> list[bytes]:
    """Delivery tags of this deployment's messages that a worker took and has not acknowledged."""
    queue = queue_name(settings).encode()
    return [tag for tag, message in client.hscan_iter("unacked") if queue in message]


class Worker:
    """`celery -A ingest.celery_app worker --pool=solo` with the deployment's environment."""

    def __init__(self, settings: Settings, log: Path):
        env = {
            **os.environ,
            "INHERENT_DATA_DIR": str(settings.data_dir),
            "INHERENT_DATABASE_URL": settings.database_url,
            "INHERENT_REDIS_URL": settings.redis_url,
            "INHERENT_COLLECTION": settings.collection,
            "INHERENT_CHUNK_TOKENS": str(settings.chunk_tokens),
            "INHERENT_CHUNK_OVERLAP": str(settings.chunk_overlap),
            "INHERENT_CELERY_VISIBILITY_TIMEOUT": str(settings.celery_visibility_timeout),
            "PYTHONPATH": str(REPO),
        }
        self.log = log
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "ingest.celery_app",
            "worker",
            "--pool=solo",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ]
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # warm shutdown: finish the task, exit
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.kill()


def write_corpus(folder: Path, count: int, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for n in range(count):
        paragraphs = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))).capitalize() + "."
            for _ in range(rng.randint(1, 3))
        ]
        name = f"doc-{n:04d}.md"
        files[name] = f"# Document {n}\n\n" + "\n\n".join(paragraphs)
        (folder / name).write_text(files[name])
    return files


def wait_until(predicate, timeout_s: float, what: str, worker: Worker):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if worker.process.poll() is not None:
            pytest.fail(f"the worker exited while waiting for {what}:\n{worker.output()}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{worker.output()}")


def finished(settings, job_id, worker, timeout_s=300) -> jobs.JobStatus:
    status = wait_until(
        lambda: (s := jobs.get_job(settings, job_id)) is not None and s.finished and s,
        timeout_s,
        "the job",
        worker,
    )
    assert status.state == "succeeded", f"{status.summary}\n{worker.output()}"
    return status


def open_index(settings: Settings) -> EdgeIndex:
    return EdgeIndex(settings.embedded_index_dir / settings.collection, 384)


def assert_index_mirrors_sql(settings: Settings, index: EdgeIndex, tenant: str) -> dict:
    sessions = get_sessionmaker(settings.database_url)
    with sessions() as s:
        expected = truth.expected_points(s, tenant)
    scanned = {p.chunk_id: p for p in index.scan(tenant)}
    assert set(scanned) == set(expected)
    assert index.count(tenant) == len(expected)  # no duplicate points
    assert all(scanned[c].same_payload(p) for c, p in expected.items())
    return expected


def test_a_worker_ingests_then_versions_changes_and_deletions(deployment, tmp_path):
    settings = deployment
    corpus = tmp_path / "corpus"
    files = write_corpus(corpus, 6, seed=1)
    worker = Worker(settings, tmp_path / "worker.log")
    try:
        first = finished(settings, jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus]), worker)
        assert (first.summary["added"], first.summary["epochs"]) == (6, [1])
        assert first.celery_task_id

        (corpus / "doc-0001.md").write_text(
            files["doc-0001.md"] + "\n\nAn added paragraph on shearing."
        )
        (corpus / "doc-0004.md").write_text("# Document 4\n\nRewritten from scratch.")
        (corpus / "doc-0002.md").unlink()
        second = finished(
            settings, jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus], cleanup="full"), worker
        )
    finally:
        worker.stop()
    summary = second.summary
    assert (summary["updated"], summary["deleted"], summary["unchanged"], summary["added"]) == (
        2,
        1,
        3,
        0,
    )
    assert summary["epochs"] == [2, 3]  # the changes in one epoch, the cleanup in the next

    sessions = get_sessionmaker(settings.database_url)
    with sessions() as s:
        assert truth.current_epoch(s, "acme") == 3
        at_1 = {v.source_id: v.version for v in truth.as_of(s, "acme", epoch=1).versions}
        at_2 = {v.source_id: v.version for v in truth.as_of(s, "acme", epoch=2).versions}
        at_3 = {v.source_id: v.version for v in truth.as_of(s, "acme", epoch=3).versions}
        changed = truth.list_versions(s, "acme", "doc-0004.md")
        gone = truth.list_versions(s, "acme", "doc-0002.md")
    assert at_1 == dict.fromkeys(files, 1)
    assert at_2 == {**at_1, "doc-0001.md": 2, "doc-0004.md": 2}
    assert at_3 == {k: v for k, v in at_2.items() if k != "doc-0002.md"}
    assert [(v.status, v.valid_from, v.valid_to) for v in changed] == [
        ("superseded", 1, 2),
        ("active", 2, OPEN_EPOCH),
    ]
    assert [(v.status, v.valid_to) for v in gone] == [("deleted", 3)]

    index = open_index(settings)
    try:
        expected = assert_index_mirrors_sql(settings, index, "acme")
        deleted_chunk = next(p for p in expected.values() if p.source_id == "doc-0002.md")
        with sessions() as s:
            stored = s.scalar(
                select(Embedding.vector).where(Embedding.chunk_hash == deleted_chunk.chunk_hash)
            )
        query = np.frombuffer(stored, dtype=np.float32)
        # The deleted source is found at epochs 1 and 2, not at 3; every hit is visible then.
        snapshots = {1: at_1, 2: at_2, 3: at_3}
        for epoch, present in [(1, True), (2, True), (3, False)]:
            hits = index.search("acme", query, epoch, 5)
            assert (hits[0].chunk_id == deleted_chunk.chunk_id) is present
            assert all(snapshots[epoch].get(expected[h.chunk_id].source_id)
                       == expected[h.chunk_id].version for h in hits)
    finally:
        index.close()


def test_a_job_whose_worker_is_killed_is_redelivered_and_finished_by_another(
        deployment, tmp_path):
    """SIGKILL the worker mid-job: nothing re-sends the job; the broker hands the unacknowledged
    message to the next worker by itself, which finishes it, converging to the state one
    uninterrupted run gives."""
    settings = deployment
    corpus = tmp_path / "corpus"
    files = write_corpus(corpus, 160, seed=2)
    sessions = get_sessionmaker(settings.database_url)

    worker = Worker(settings, tmp_path / "worker-1.log")
    try:
        job_id = jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus], batch_size=8)
        wait_until(
            lambda: (
                (s := jobs.get_job(settings, job_id)).done_sources >= 24 and s.state == "running"
            ),
            300,
            "the job to be part way",
            worker,
        )
        worker.kill()
    finally:
        worker.stop()
    interrupted = jobs.get_job(settings, job_id)
    assert interrupted.state == "running", (
        "the job finished before the kill: make the corpus larger"
    )
    with sessions() as s:
        committed = len(truth.list_sources(s, "acme"))
    assert 0 < committed < len(files)
    broker = redis.Redis.from_url(REDIS_URL)
    assert len(unacked_tags(broker, settings)) == 1  # the killed worker's message, held back

    worker = Worker(settings, tmp_path / "worker-2.log")
    try:
        status = finished(settings, job_id, worker)
    finally:
        worker.stop()
    # The same task message, received again by the new worker, and acknowledged this time.
    task_id = interrupted.celery_task_id
    assert status.celery_task_id == task_id
    assert f"Task inherent.ingest[{task_id}] received" in worker.output()
    assert unacked_tags(broker, settings) == [] and broker.llen(queue_name(settings)) == 0
    assert (status.summary["unchanged"], status.summary["added"]) == (
        committed,
        len(files) - committed,
    )
    assert status.total_sources == status.done_sources == len(files)

    # Exactly one version per source, holding exactly the chunks the chunker makes of it.
    chunker = Chunker(load_tokenizer(bundled_model_dir()), CHUNK_TOKENS, CHUNK_OVERLAP)
    with sessions() as s:
        for source in truth.list_sources(s, "acme"):
            assert [v.version for v in truth.list_versions(s, "acme", source.source_id)] == [1]
        stored = {}
        for chunk in truth.chunks_as_of(s, "acme", truth.current_epoch(s, "acme")):
            stored.setdefault(chunk.source_id, []).append(chunk.chunk_hash)
    assert stored == {
        name: [c.chunk_hash for c in chunker.chunk(normalize_text(text))]
        for name, text in files.items()
    }
    index = open_index(settings)
    try:
        expected = assert_index_mirrors_sql(settings, index, "acme")
        assert len(expected) == sum(len(h) for h in stored.values())
        report = truth.sweep(sessions, index, "acme")
        assert (report.orphans_deleted, report.payloads_repaired, report.points_missing) == (
            0,
            0,
            0,
        )
    finally:
        index.close()
