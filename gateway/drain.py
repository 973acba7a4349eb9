"""Graceful shutdown: on SIGTERM the API drains before uvicorn stops it.

Kubernetes (and compose) send SIGTERM and keep routing to the pod for a moment; uvicorn's own
handling would close the listening socket at once. Instead, the first SIGTERM starts a drain:
``/readyz`` answers 503 so the load balancer takes the replica out, every new request is
refused with 503 (``Retry-After``) so clients retry on another replica, and the requests in
flight (streams included: an ASGI call ends when its last body chunk is sent) run to their end.
When none is left, or ``Settings.shutdown_grace_s`` has passed, uvicorn's normal shutdown takes
over: it closes the sockets, gives stragglers a last few seconds, and runs the lifespan's
shutdown. A second SIGTERM or a SIGINT skips the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

# uvicorn's logger: configured by `inherent serve`, so the drain shows in the server's log.
log = logging.getLogger("uvicorn.error")

# Probes and scrapes are answered while draining: liveness must not fail (the kubelet would
# kill the pod mid-stream), readiness says 503 itself, metrics show the drain.
UNGATED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class Drain:
    """Requests in flight and whether the process is draining."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.in_flight = 0
        self.started_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def start(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()
            log.info(
                "draining: %d request(s) in flight, up to %.0f s to finish",
                self.in_flight, self.grace_s,
            )

    def done(self) -> bool:
        """Draining, and nothing is left in flight or the grace period is over."""
        if self.started_at is None:
            return False
        return self.in_flight == 0 or time.monotonic() - self.started_at >= self.grace_s


class DrainMiddleware:
    """Counts requests in flight; refuses new ones with 503 while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = APIError(
                503,
                "this replica is shutting down; retry the request",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": "1", "Connection": "close"},
            ).response()
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain between the first SIGTERM and its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers, delivered through the event loop instead of ``signal.signal``.

        A Python-level handler runs only when the main thread next checks for signals, and on
        CPython 3.11 another thread (the engine's step loop) recomputing the interpreter's
        eval breaker can hide a pending signal from the main thread for a while: the likeliest
        reason a CI run once read 200 from ``/readyz`` just after SIGTERM. The loop's handlers
        come through its wakeup fd, so the drain starts at the loop's next turn. uvicorn's own
        context still restores the previous handlers and re-raises what it captured."""
        with super().capture_signals():
            loop = asyncio.get_running_loop()
            on_main_thread = threading.current_thread() is threading.main_thread()
            handled = (signal.SIGINT, signal.SIGTERM) if on_main_thread else ()
            for sig in handled:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in handled:
                    loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining:
            self.drain.start()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
