"""The asyncio front: a background thread drives the engine's `step()` (either mode); each
request streams its outputs through an asyncio.Queue on the loop that asked for it.

A consumer that goes away (generator closed, task cancelled) aborts its request; the engine
frees the request's blocks at its next step.
"""

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.engine_protocol import Engine
from engine.factory import create_engine
from engine.request_output import RequestOutput
from engine.sampling import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="inherent-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, registry: CollectorRegistry | None = None
                    ) -> "AsyncEngine":
        """Load the configured model and start the engine thread."""
        return cls(create_engine(config, registry))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set and carries the
        request's timeline summary in `metrics`. Invalid or overloaded requests raise
        (InvalidRequest, EngineOverloaded) at the first iteration, before any work."""
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        # Listen before queueing: the engine thread may run the request's first step at once.
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt, params, request_id)
        except BaseException:
            del self._streams[request_id]
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort_request(request_id)
                self._wake.set()

    def is_healthy(self) -> bool:
        """The step thread runs and the engine behind it (workers, in disaggregated mode) is up."""
        return self._thread.is_alive() and not self._stopping and self.engine.is_healthy()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    # -- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            if not engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = [(out.request_id, out) for out in engine.step()]
            except Exception as error:  # fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                try:
                    failed = engine.fail_all()
                except Exception:  # the engine cannot even retire requests: stop serving
                    log.exception("engine cannot recover; shutting down")
                    self._stopping = True
                    failed = list(self._streams)
                outputs = [(request_id, error) for request_id in failed]
            if outputs:
                self._deliver(outputs)

    def _deliver(self, outputs: list[tuple[str, RequestOutput | Exception]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, out in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
