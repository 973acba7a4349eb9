"""Schemathesis fuzzes every route of the OpenAPI document against a live server: valid and
invalid data, with the default checks (no 5xx, status codes, content types, headers and bodies
as documented, invalid data refused). A tiny random model keeps each request cheap; what is
fuzzed is the HTTP surface, not the model."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from engine_fixtures import write_tiny_llama

from gateway.app import create_app
from gateway.auth import create_key
from gateway.settings import ServerSettings
from provenance.db import session_scope
from provenance.migrate import ensure_schema

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """A real uvicorn server on the tiny model: (base URL, an all-scopes key)."""
    root = tmp_path_factory.mktemp("fuzz")
    settings = ServerSettings(
        data_dir=root / "data",
        model_path=str(write_tiny_llama(root / "model", max_position_embeddings=4096)),
        database_url="",
        qdrant_url="",
        redis_url="",
        kv_cache_tokens=4096,
        tenant_requests_per_minute=0,  # the fuzzer is one tenant sending many requests
        max_file_bytes=64 * 1024,
        max_upload_body_bytes=256 * 1024,
    )
    settings.data_dir.mkdir()
    ensure_schema(settings.sqlalchemy_url)
    with session_scope(settings.sqlalchemy_url, write=True) as session:
        secret = create_key(session, "fuzz", ["chat", "admin", "audit"]).secret
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 900  # a first run builds the CPU kernels
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}", secret
    server.should_exit = True
    thread.join(timeout=60)
    from provenance.vector_index import close_vector_indexes

    close_vector_indexes()


def test_every_route_survives_the_fuzzer(live_server, tmp_path):
    """Schemathesis's own runner, as a user would run it in CI: exit 0 means no check failed."""
    base_url, secret = live_server
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file",
        str(Path(__file__).with_name("schemathesis.toml")),
        "run",
        f"{base_url}/openapi.json",
        "--header",
        f"Authorization: Bearer {secret}",
        "--mode",
        "all",  # valid and invalid data
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--seed",
        "14",
        "--generation-deterministic",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    (tmp_path / "schemathesis.txt").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, run.stdout[-30000:] + run.stderr[-2000:]
