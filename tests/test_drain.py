"""SIGTERM drains a real uvicorn server: readiness fails, new requests get 503, the stream in
flight finishes, then the server exits; a stream longer than the grace period is cut."""

import asyncio
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.responses import StreamingResponse

from gateway.app import create_app
from gateway.drain import DrainingServer
from provenance.settings import Settings


class IdleServices:
    """What the lifespan needs from Services, without a model."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def healthy(self) -> bool:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(grace_s: float, chunks: int):
        settings = Settings(data_dir=tmp_path, shutdown_grace_s=grace_s)
        app = create_app(settings, services_factory=lambda *_: IdleServices())

        @app.get("/slow")
        async def slow() -> StreamingResponse:
            async def body():
                for i in range(chunks):
                    yield f"chunk {i}\n"
                    await asyncio.sleep(0.2)

            return StreamingResponse(body(), media_type="text/plain")

        port = free_port()
        config = uvicorn.Config(app, port=port, log_level="warning", timeout_graceful_shutdown=1)
        server = DrainingServer(config, app.state.drain)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        servers.append(server)
        return server, thread, f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.force_exit = server.should_exit = True


def test_sigterm_drains_then_exits(serve):
    server, thread, url = serve(grace_s=30, chunks=8)
    assert httpx.get(f"{url}/readyz").status_code == 200
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{url}/slow") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "chunk 0"
        server.handle_exit(signal.SIGTERM, None)

        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["accepting"] is False
        refused = httpx.get(f"{url}/slow")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/healthz").status_code == 200  # liveness holds: no kill mid-stream
        assert server.should_exit is False  # still serving the stream

        assert list(lines) == [f"chunk {i}" for i in range(1, 8)]
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not exit once the stream ended"


def test_the_grace_period_bounds_the_drain(serve):
    server, thread, url = serve(grace_s=0.5, chunks=100)  # a 20 s stream
    start = time.monotonic()
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{url}/slow") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "chunk 0"
        server.handle_exit(signal.SIGTERM, None)
        with pytest.raises(httpx.HTTPError):
            list(lines)  # cut when the grace (and uvicorn's own last second) ran out
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - start < 10
