"""The production shape on one machine: PostgreSQL and Redis, the schema migrated once, two API
replicas (real `inherent serve` processes) and one Celery worker, each with its own data
directory and no file shared between them.

One pass, in order: a replica refuses the unmigrated database; `inherent db upgrade` runs once;
an ingestion submitted through replica A runs on the worker; replica B deprecates a source;
both replicas answer the same questions with identical retrieval, at the current epoch and at a
pinned snapshot; receipts from both land in one audit log; SIGTERM to A in the middle of a
stream lets the stream finish and A exit; B replays A's streamed answer as `identical`; and
`inherent audit verify` finds the log intact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from importlib import resources
from pathlib import Path

import httpx
import pytest

from gateway.auth import create_key
from provenance import merkle
from provenance.db import session_scope
from tests.conftest import REDIS_URL
from tests.draining_server import leaves_rotation

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not REDIS_URL, reason="INHERENT_TEST_REDIS_URL is not set: no Redis"),
]

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 600  # two model loads at once on a small, shared machine
QUESTION = "How do I turn on two-factor authentication?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """The processes of one deployment and the environment they share (not their files)."""

    def __init__(self, root: Path, database_url: str) -> None:
        self.root = root
        self.processes: dict[str, subprocess.Popen] = {}
        base = {k: v for k, v in os.environ.items() if not k.startswith("INHERENT_")}
        self.env = {
            **base,
            "INHERENT_DATABASE_URL": database_url,
            "INHERENT_REDIS_URL": REDIS_URL,
            # Its own Celery queue: other test runs on the same Redis never take these jobs.
            "INHERENT_COLLECTION": f"prod_{uuid.uuid4().hex[:8]}",
            "INHERENT_BATCH_INVARIANT": "true",
            "INHERENT_KV_CACHE_TOKENS": "8192",
            "INHERENT_MAX_NUM_SEQS": "4",
            "INHERENT_SHUTDOWN_GRACE_S": "120",
            "INHERENT_INDEX_SYNC_INTERVAL_S": "0.5",
        }

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """A one-shot `inherent` command (its own data dir, like a Job's pod)."""
        env = {**self.env, "INHERENT_DATA_DIR": str(self.data_dir("cli"))}
        return subprocess.run(
            [str(BIN / "inherent"), *args], env=env, capture_output=True, text=True, timeout=300
        )

    def data_dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        env = {**self.env, "INHERENT_DATA_DIR": str(self.data_dir(name))}
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = process
        return process

    def serve(self, name: str) -> str:
        port = free_port()
        self.start(name, [str(BIN / "inherent"), "serve", "--port", str(port)])
        return f"http://127.0.0.1:{port}"

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-4000:]

    def wait_ready(self, name: str, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.processes[name].poll() is not None:
                pytest.fail(f"{name} exited at start:\n{self.log(name)}")
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail(f"{name} not ready after {START_TIMEOUT_S} s:\n{self.log(name)}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def deployment(pg_url, tmp_path):
    deployment = Deployment(tmp_path, pg_url)
    yield deployment
    deployment.stop()


def chat(url: str, key: str, snapshot: int | None = None, **extra) -> dict:
    body = {
        "model": "inherent",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 4,
        "inherent": {"snapshot": snapshot} if snapshot is not None else {},
        **extra,
    }
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=300
    )
    assert response.status_code == 200, response.text
    return response.json()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def retrieval(reply: dict) -> list[tuple]:
    return [(c["chunk_id"], c["chunk_hash"], c["score"]) for c in reply["citations"]]


def test_two_replicas_and_a_worker_share_nothing_but_the_databases(deployment, pg_url, tmp_path):
    # A replica refuses a database nobody migrated, and says what to do.
    refused = deployment.run("serve", "--port", str(free_port()))
    assert refused.returncode != 0
    assert "inherent db upgrade" in refused.stderr + refused.stdout

    # The migration runs once, as its own job.
    migrated = deployment.run("db", "upgrade")
    assert migrated.returncode == 0, migrated.stderr
    with session_scope(pg_url, write=True) as session:
        key = create_key(session, "acme", ["chat", "admin", "audit"]).secret

    deployment.start(
        "worker",
        [str(BIN / "celery"), "-A", "ingest.celery_app", "worker", "--pool=solo",
         "--loglevel=warning", "--without-gossip", "--without-mingle", "--without-heartbeat"],
    )
    url_a, url_b = deployment.serve("api-a"), deployment.serve("api-b")
    deployment.wait_ready("api-a", url_a)
    deployment.wait_ready("api-b", url_b)

    # Ingest through replica A, uploaded as a tenant does; the bytes travel through the
    # database, and the worker, which shares no file with A, runs the job.
    corpus = Path(str(resources.files("gateway") / "demo_corpus"))
    files = [("files", (f.name, f.read_bytes())) for f in sorted(corpus.iterdir())]
    submitted = httpx.post(
        f"{url_a}/admin/ingest", files=files, headers=bearer(key), timeout=60
    )
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    deadline = time.monotonic() + 300
    while not job["finished"]:
        assert time.monotonic() < deadline, f"job not done:\n{deployment.log('worker')}"
        time.sleep(0.5)
        job = httpx.get(f"{url_a}/admin/jobs/{job['id']}", headers=bearer(key)).json()
    assert job["state"] == "succeeded", job
    ingested = max(job["summary"]["epochs"])

    # Replica B changes the truth too: the legacy article is deprecated at a new epoch.
    deprecated = httpx.post(
        f"{url_b}/admin/sources/legacy-two-factor.md/deprecate", headers=bearer(key), timeout=60
    )
    assert deprecated.status_code == 200, deprecated.text
    current = deprecated.json()["epoch"]
    assert current > ingested
    for name in ("api-a", "api-b", "worker"):
        # os.walk, not rglob: the running replicas' index renames its temporary folders away,
        # and a folder gone between listing and reading must not fail the walk.
        held = [f for _, _, files in os.walk(deployment.root / name) for f in files]
        assert not any(f.endswith(".md") for f in held), f"{name} holds corpus files"

    # The same retrieval on both replicas, now and at the pinned snapshot of the ingestion.
    answers = {
        (replica, snapshot): chat(url, key, snapshot)
        for replica, url in (("a", url_a), ("b", url_b))
        for snapshot in (None, ingested)
    }
    assert retrieval(answers["a", None]) == retrieval(answers["b", None])
    assert retrieval(answers["a", ingested]) == retrieval(answers["b", ingested])
    pinned_sources = {c["source_id"] for c in answers["b", ingested]["citations"]}
    current_sources = {c["source_id"] for c in answers["b", None]["citations"]}
    assert "legacy-two-factor.md" in pinned_sources - current_sources

    # Receipts from both replicas are leaves of the one audit log, readable from either, and
    # each proves its inclusion under the same root.
    proofs = []
    for replica, url in (("a", url_b), ("b", url_a)):
        receipt_id = answers[replica, None]["receipt_id"]
        read = httpx.get(f"{url}/v1/receipts/{receipt_id}", headers=bearer(key))
        assert read.status_code == 200, read.text
        proofs.append(read.json()["inclusion_proof"])
    assert proofs[0]["tree_size"] == proofs[1]["tree_size"] and proofs[0]["root"] == proofs[1]["root"]
    for proof in proofs:
        assert merkle.verify_inclusion(
            proof["leaf_index"],
            proof["tree_size"],
            bytes.fromhex(proof["leaf_hash"]),
            [bytes.fromhex(h) for h in proof["audit_path"]],
            bytes.fromhex(proof["root"]),
        )

    # SIGTERM to A in the middle of a stream: the stream finishes, A stops admitting, A exits.
    body = {
        "model": "inherent",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 48,
        "stream": True,
    }
    api_a = deployment.processes["api-a"]
    with httpx.stream(
        "POST", f"{url_a}/v1/chat/completions", json=body, headers=bearer(key), timeout=300
    ) as stream:
        assert stream.status_code == 200
        streamed_id = stream.headers["x-receipt-id"]
        events = stream.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        api_a.send_signal(signal.SIGTERM)
        leaves_rotation(url_a, lambda: deployment.log("api-a"))  # before the stream ends
        refused = httpx.get(f"{url_a}/v1/models", headers=bearer(key), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        rest = [line.removeprefix("data: ") for line in events if line.startswith("data: ")]
    chunks = [json.loads(first.removeprefix("data: "))] + [json.loads(e) for e in rest[:-1]]
    assert rest[-1] == "[DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["receipt_id"] == streamed_id
    assert api_a.wait(timeout=120) == 0, deployment.log("api-a")

    # B replays the answer A streamed while it was shutting down: the same bits.
    replayed = httpx.post(
        f"{url_b}/v1/receipts/{streamed_id}/replay", headers=bearer(key), timeout=300
    )
    assert replayed.status_code == 200, replayed.text
    assert replayed.json()["context_verified"] is True
    assert replayed.json()["verdict"] == "identical"

    verified = deployment.run("audit", "verify")
    assert verified.returncode == 0, verified.stderr
    assert "audit log intact" in verified.stdout
