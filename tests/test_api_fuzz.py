"""Schemathesis fuzzes every route of the OpenAPI document against a live server: valid and
invalid data, with the default checks (no 5xx, status codes, content types, headers and bodies
as documented, invalid data refused). A tiny random model keeps each request cheap; what is
fuzzed is the HTTP surface, not the model."""

import socket
import threading
import time

import pytest
import schemathesis
import uvicorn
from engine_fixtures import write_tiny_llama
from schemathesis import GenerationMode

from gateway.app import create_app
from gateway.auth import create_key
from provenance.db import session_scope
from provenance.migrate import ensure_schema
from provenance.settings import Settings

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 25
HEADERS: dict[str, str] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_schema(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    settings = Settings(
        data_dir=root / "data",
        model_path=str(write_tiny_llama(root / "model")),
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
    HEADERS["Authorization"] = f"Bearer {secret}"
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{port}/openapi.json")
    schema.config.update(headers=HEADERS)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=EXAMPLES_PER_OPERATION,
        deterministic=True,
    )
    yield schema
    server.should_exit = True
    thread.join(timeout=60)
    from provenance.vector_index import close_vector_indexes

    close_vector_indexes()


schema = schemathesis.pytest.from_fixture("live_schema")


@schema.parametrize()
def test_every_route_survives_the_fuzzer(case):
    case.call_and_validate(headers=HEADERS, timeout=60)
