"""A live app on the bundled model and the embedded default, shared by the API tests."""

import shutil
from importlib import resources
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.auth import create_key
from gateway.settings import ServerSettings
from ingest import jobs
from provenance.db import session_scope
from provenance.migrate import ensure_schema


class Api:
    def __init__(self, client: TestClient, settings: ServerSettings, corpus: Path, app=None):
        """``app``: the application behind ``client`` (a TestClient knows its own; a client of
        a live server does not)."""
        self.client, self.settings, self.corpus = client, settings, corpus
        self.app = app if app is not None else client.app
        self.keys: dict[tuple[str, tuple[str, ...]], str] = {}

    def key(self, tenant: str = "acme", *scopes: str) -> str:
        scopes = scopes or ("chat", "admin", "audit")
        if (tenant, scopes) not in self.keys:
            with session_scope(self.settings.sqlalchemy_url, write=True) as session:
                self.keys[tenant, scopes] = create_key(session, tenant, list(scopes)).secret
        return self.keys[tenant, scopes]

    def auth(self, tenant: str = "acme", *scopes: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key(tenant, *scopes)}"}

    def ingest(self, tenant: str, *paths: Path) -> jobs.JobStatus:
        runtime = self.app.state.services.runtime  # the API's own embedder and index
        job_id = jobs.submit_ingestion(runtime, tenant, [str(p) for p in paths], wait=True)
        status = jobs.get_job(self.settings, job_id)
        assert status.state == "succeeded", status
        return status

    def chat(self, question: str, tenant: str = "acme", **extra) -> dict:
        body = {
            "model": "inherent",
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 24,
            **extra,
        }
        response = self.client.post("/v1/chat/completions", json=body, headers=self.auth(tenant))
        assert response.status_code == 200, response.text
        return response.json()


def serve_api(tmp_path_factory, ingest: bool = True, **settings):
    """A live app on a fresh embedded data dir with the demo corpus ingested for tenant acme
    (unless ``ingest`` is false)."""
    data_dir = tmp_path_factory.mktemp("inherent")
    # 8192 KV tokens: a few concurrent RAG answers fit, and the app starts seconds sooner than
    # with the server's default 32768 (1.5 GB of float32 cache, zeroed at start).
    settings = ServerSettings(data_dir=data_dir, database_url="", qdrant_url="", redis_url="",
                        **{"max_waiting_requests": 64, "kv_cache_tokens": 8192, **settings})
    ensure_schema(settings.sqlalchemy_url)
    corpus = data_dir / "corpus"
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), corpus)
    app = create_app(settings)
    with TestClient(app) as client:
        api = Api(client, settings, corpus)
        if ingest:
            api.ingest("acme", corpus)
        yield api
    from provenance.vector_index import close_vector_indexes

    close_vector_indexes()


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Api:
    yield from serve_api(tmp_path_factory)
