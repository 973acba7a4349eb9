"""Faults under load, on a private PostgreSQL and Redis this test restarts (never the shared ones).

PostgreSQL is stopped under 16 live requests (half streaming) and started again: every request
either completes with its receipt committed or fails closed (503 with Retry-After, or a stream
whose last event is an error naming no receipt), requests during the outage are refused before
generation, the service recovers by itself, and ``inherent audit verify`` is intact. Redis is
restarted while a Celery worker runs an ingestion job: the job completes, the worker takes the
next job, and no version, chunk or point is duplicated.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.auth import create_key
from gateway.settings import ServerSettings
from ingest import jobs
from ingest.chunking import Chunker, normalize_text
from ingest.embedding import bundled_model_dir, load_tokenizer
from provenance import truth
from provenance.db import get_engine, get_sessionmaker, session_scope
from provenance.migrate import upgrade
from provenance.models import Chunk, Receipt
from provenance.settings import Settings
from tests.fault_support import PrivatePostgres, PrivateRedis, free_port
from tests.test_ingest_integration import (
    CHUNK_OVERLAP,
    CHUNK_TOKENS,
    Worker,
    assert_index_mirrors_sql,
    finished,
    open_index,
    wait_until,
    write_corpus,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
LIVE = 16
QUESTIONS = [
    "How long does a password reset link stay valid?",
    "How much does the Plus plan cost?",
    "How do I share a folder with a link?",
    "Why does sync stop on my laptop?",
]


@pytest.fixture(scope="module")
def postgres():
    server = PrivatePostgres()
    yield server
    get_engine.cache_clear()
    server.close()


def audit_verify(database_url: str, data_dir: Path) -> str:
    """`inherent audit verify`, as an operator runs it."""
    environment = {
        **os.environ,
        "INHERENT_DATABASE_URL": database_url,
        "INHERENT_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import app; app()", "audit", "verify"],
        env=environment,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


class Server:
    """The app on a real uvicorn server on 127.0.0.1, in a thread of this process."""

    def __init__(self, settings: Settings):
        self.app = create_app(settings)
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 600
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(120)


async def ask(client: httpx.AsyncClient, n: int, stream: bool, started: asyncio.Event) -> dict:
    """One request; the outcome as the client saw it."""
    body = {
        "model": "inherent",
        "messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}],
        "temperature": 0,
        "max_tokens": 48,
        "stream": stream,
    }
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            return {"outcome": "completed", "receipt_id": response.json()["receipt_id"]}
        return {
            "outcome": "refused",
            "status": response.status_code,
            "retry_after": response.headers.get("Retry-After"),
            "code": response.json()["error"]["code"],
        }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {
                "outcome": "refused",
                "status": response.status_code,
                "retry_after": response.headers.get("Retry-After"),
                "code": response.json()["error"]["code"],
            }
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    final = json.loads(events[-2])
    if "error" in final:
        return {"outcome": "stream_error", "code": final["error"]["code"], "event": final}
    return {"outcome": "completed", "receipt_id": final["receipt_id"]}


def receipt_ids(database_url: str) -> set[str]:
    with session_scope(database_url) as session:
        return set(session.scalars(select(Receipt.id)))


def test_postgresql_restarted_under_16_live_requests_loses_no_receipt(postgres, tmp_path):
    database_url = postgres.create_database("chat")
    settings = ServerSettings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        qdrant_url="",
        redis_url="",
        max_waiting_requests=64,
        receipt_commit_timeout_s=2.0,
    )
    upgrade(database_url)
    corpus = tmp_path / "corpus"
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), corpus)
    job = jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus], wait=True)
    assert jobs.get_job(settings, job).state == "succeeded"
    with session_scope(database_url, write=True) as session:
        key = create_key(session, "acme", ["chat"]).secret

    server = Server(settings)
    try:
        outcomes, during, after = asyncio.run(
            drive(server, postgres, key, settings.receipt_commit_timeout_s)
        )
    finally:
        server.stop()

    completed = {o["receipt_id"] for o in outcomes if o["outcome"] == "completed"}
    closed = [o for o in outcomes if o["outcome"] != "completed"]
    assert len(completed) + len(closed) == LIVE
    assert closed, "no request finished while the database was down: the outage was too short"
    for o in closed:  # failed closed, never a 500
        if o["outcome"] == "refused":
            assert (o["status"], o["code"]) == (503, "receipt_not_committed") and o["retry_after"]
        else:
            assert o["code"] == "receipt_not_committed" and "receipt_id" not in o["event"]
    # Requests that arrived during the outage were refused before any generation.
    assert {(o["status"], o["code"]) for o in during} == {(503, "database_unavailable")}
    assert all(o["retry_after"] for o in during)
    # Back without a restart of the gateway: pre-ping replaced the cut pooled connections.
    assert all(o["outcome"] == "completed" for o in after)

    stored = receipt_ids(database_url)
    reported = completed | {o["receipt_id"] for o in after}
    assert reported <= stored  # every answer reported complete has its receipt
    warmups = 1
    assert len(stored) == len(reported) + warmups  # and nothing else was written
    with session_scope(database_url) as session:
        assert set(session.scalars(select(Receipt.status).where(Receipt.id.in_(reported)))) == {
            "ok"
        }
    assert "intact" in audit_verify(database_url, settings.data_dir)


async def drive(server: Server, postgres: PrivatePostgres, key: str, timeout_s: float):
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=600, limits=limits
    ) as client:
        warm = await ask(client, 0, False, asyncio.Event())
        assert warm["outcome"] == "completed", warm
        started = [asyncio.Event() for _ in range(LIVE)]
        live = [
            asyncio.create_task(ask(client, n, stream=n % 2 == 0, started=started[n]))
            for n in range(LIVE)
        ]
        # Every stream has its first token: all 16 are past retrieval and generating.
        await asyncio.wait_for(
            asyncio.gather(*(started[n].wait() for n in range(0, LIVE, 2))), 600
        )
        await asyncio.to_thread(postgres.stop)
        during = [await ask(client, n, stream=n % 2 == 0, started=asyncio.Event()) for n in range(2)]
        # Down until some request has failed closed (or all are done), then up again.
        deadline = time.monotonic() + 600
        while not any(t.done() and t.result()["outcome"] != "completed" for t in live):
            if all(t.done() for t in live) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        await asyncio.to_thread(postgres.start)
        outcomes = await asyncio.gather(*live)
        after = [await ask(client, n, stream=n % 2 == 0, started=asyncio.Event()) for n in range(4)]
    return outcomes, during, after


def test_redis_restarted_mid_job_the_job_completes_without_duplicates(postgres, tmp_path):
    database_url = postgres.create_database("ingest")
    upgrade(database_url)
    redis = PrivateRedis(tmp_path / "redis.log")
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        redis_url=redis.url,
        collection="faults",
        chunk_tokens=CHUNK_TOKENS,
        chunk_overlap=CHUNK_OVERLAP,
    )
    corpus = tmp_path / "corpus"
    files = write_corpus(corpus, 160, seed=3)
    worker = Worker(settings, tmp_path / "worker.log")
    try:
        job_id = jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus], batch_size=8)
        wait_until(
            lambda: (s := jobs.get_job(settings, job_id)).state == "running"
            and s.done_sources >= 16,
            300,
            "the job to be part way",
            worker,
        )
        redis.stop()  # the broker goes away with the job in hand (and loses every key)...
        time.sleep(2)
        redis.start()  # ...and comes back on the same port
        first = finished(settings, job_id, worker)
        # The worker reconnected: a job sent after the restart runs too.
        (corpus / "doc-0007.md").write_text("# Document 7\n\nRewritten after the restart.")
        second = finished(settings, jobs.submit_ingestion(jobs.Runtime(settings), "acme", [corpus]), worker)
    finally:
        worker.stop()
        redis.close()
    assert first.total_sources == first.done_sources == len(files)
    assert (first.summary["added"], first.summary["failed"]) == (len(files), 0)
    assert (second.summary["updated"], second.summary["unchanged"]) == (1, len(files) - 1)

    sessions = get_sessionmaker(database_url)
    with sessions() as s:
        for source in truth.list_sources(s, "acme"):
            want = [1, 2] if source.source_id == "doc-0007.md" else [1]
            assert [v.version for v in truth.list_versions(s, "acme", source.source_id)] == want
        stored = {}
        for chunk in truth.chunks_as_of(s, "acme", truth.current_epoch(s, "acme")):
            stored.setdefault(chunk.source_id, []).append(chunk.chunk_hash)
        total_chunks = s.scalar(select(func.count()).select_from(Chunk))
    files["doc-0007.md"] = "# Document 7\n\nRewritten after the restart."
    chunker = Chunker(load_tokenizer(bundled_model_dir()), CHUNK_TOKENS, CHUNK_OVERLAP)
    assert stored == {
        name: [c.chunk_hash for c in chunker.chunk(normalize_text(text))]
        for name, text in files.items()
    }
    index = open_index(settings)
    try:
        expected = assert_index_mirrors_sql(settings, index, "acme")  # no duplicate points
        assert len(expected) == total_chunks
    finally:
        index.close()
    assert "intact" in audit_verify(database_url, settings.data_dir)
