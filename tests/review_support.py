"""A live HTTP server (uvicorn in a thread) for the review console's browser tests.

The browser needs a real socket, so the app runs under uvicorn rather than TestClient. It serves
a tiny random Llama (tests/engine_fixtures.py) with a byte-level tokenizer: fast on two CPU
cores, and its RAG prompts run to hundreds of tokens, so every answer has several prefill chunks
to draw. Batch-invariant mode, as in ``inherent demo``, so replay can read ``identical``.
"""

import shutil
import socket
import threading
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import httpx
import pytest
import uvicorn
from api_support import Api
from engine_fixtures import write_tiny_llama

from gateway.app import create_app
from gateway.settings import ServerSettings
from provenance.migrate import ensure_schema

CHROMIUM = Path("/usr/bin/chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app, port: int):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    # The lifespan loads the model and the embedder, and may build the C++ kernels (minutes on a
    # busy machine).
    deadline = time.monotonic() + 900
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def serve_live(tmp_path_factory):
    """Yields (Api over HTTP, base URL) with the demo corpus ingested for tenant acme."""
    data_dir = tmp_path_factory.mktemp("inherent-live")
    model = write_tiny_llama(data_dir / "tiny-llama", max_position_embeddings=4096)
    settings = ServerSettings(data_dir=data_dir, database_url="", qdrant_url="", redis_url="",
                        model_path=str(model), batch_invariant=True, max_waiting_requests=64)
    ensure_schema(settings.sqlalchemy_url)
    corpus = data_dir / "corpus"
    shutil.copytree(Path(str(resources.files("gateway") / "demo_corpus")), corpus)
    app = create_app(settings)
    with live_server(app, free_port()) as url, httpx.Client(base_url=url, timeout=300) as client:
        api = Api(client, settings, corpus, app)
        api.ingest("acme", corpus)
        yield api, url
    from provenance.vector_index import close_vector_indexes

    close_vector_indexes()


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright; skipped with the reason when either is missing."""
    if not CHROMIUM.exists():
        pytest.skip("Chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        yield browser
        browser.close()
