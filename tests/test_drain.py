"""SIGTERM drains a real uvicorn server: readiness fails, new requests get 503, the stream in
flight finishes, then the server exits; a stream longer than the grace period is cut; a second
SIGTERM skips the drain. The last tests send real signals to a server in its own process."""

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.drain import DrainingServer
from tests.draining_server import leaves_rotation, slow_app

DRAINING_SERVER = Path(__file__).with_name("draining_server.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(grace_s: float, chunks: int):
        app = slow_app(tmp_path, grace_s, chunks, every_s=0.2)
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


@pytest.fixture
def server_process(tmp_path):
    """tests/draining_server.py in its own process, ready; killed if a test leaves it running."""
    processes = []

    def start(grace_s: float):
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, str(DRAINING_SERVER), str(tmp_path), str(port), str(grace_s)]
        )
        processes.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                time.sleep(0.1)

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_real_sigterm_takes_the_replica_out(server_process):
    """Through the handlers DrainingServer installs in the server's main thread (the tests
    above call handle_exit themselves), with another thread taking the GIL as the engine does."""
    process, url = server_process(grace_s=30)
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{url}/slow") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "chunk 0"
        process.send_signal(signal.SIGTERM)
        leaves_rotation(url)
        assert httpx.get(f"{url}/slow", timeout=10).json()["error"]["code"] == "shutting_down"
        assert list(lines) == [f"chunk {i}" for i in range(1, 20)]
    assert process.wait(timeout=30) == 0


def test_a_second_sigterm_skips_the_drain(server_process):
    process, url = server_process(grace_s=30)
    start = time.monotonic()
    with httpx.Client(timeout=30) as client, client.stream("GET", f"{url}/slow") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "chunk 0"
        process.send_signal(signal.SIGTERM)
        leaves_rotation(url)
        process.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.HTTPError):
            list(lines)  # uvicorn's own shutdown cuts the stream after its last second
    # uvicorn re-raises the signal it shut down for, with the handler it found restored
    assert process.wait(timeout=30) == -signal.SIGTERM
    assert time.monotonic() - start < 10
