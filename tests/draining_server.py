"""The gateway's app without a model behind ``DrainingServer`` in a process's main thread, where
real signals reach it; started by tests/test_drain.py.

    python tests/draining_server.py DATA_DIR PORT GRACE_S

A Python thread keeps taking the GIL as the engine's step loop does, and ``/slow`` streams 20
lines, one every 0.1 s. ``leaves_rotation`` is the readiness check after a SIGTERM that this
server's tests and the production test share.
"""

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI
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


def slow_app(data_dir: Path, grace_s: float, chunks: int, every_s: float) -> FastAPI:
    """The app, with ``/slow`` streaming ``chunks`` lines ``every_s`` apart."""
    app = create_app(Settings(data_dir=data_dir, shutdown_grace_s=grace_s),
                     services_factory=lambda *_: IdleServices())

    @app.get("/slow")
    async def slow() -> StreamingResponse:
        async def body():
            for i in range(chunks):
                yield f"chunk {i}\n"
                await asyncio.sleep(every_s)

        return StreamingResponse(body(), media_type="text/plain")

    return app


def leaves_rotation(url: str, log: Callable[[], str] = lambda: "") -> None:
    """/readyz answers 503 within 5 s of a SIGTERM: a signal is asynchronous, and a load balancer
    polls readiness every few seconds. ``log``: the server's log, for the failure message."""
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/readyz", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, f"still ready 5 s after SIGTERM\n{log()}"
        time.sleep(0.05)


def keep_the_gil_busy() -> None:
    while True:
        sum(i * i for i in range(2000))


if __name__ == "__main__":
    data_dir, port, grace_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    app = slow_app(data_dir, grace_s, chunks=20, every_s=0.1)
    threading.Thread(target=keep_the_gil_busy, daemon=True).start()
    config = uvicorn.Config(app, port=port, log_level="warning", timeout_graceful_shutdown=1)
    DrainingServer(config, app.state.drain).run()
