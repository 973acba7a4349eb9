"""The asyncio front: a background thread drives the engine's `step()` (either mode); each
request streams its outputs through an asyncio.Queue on the loop that asked for it.

A consumer that goes away (generator closed, task cancelled) aborts its request; the engine
frees the request's blocks at its next step.

Other compute of the same process can run on the engine thread between steps
(`run_between_steps`): the API's query embeddings do. Torch gives every thread that runs a
parallel kernel its own OpenMP team; a second team beside the engine's oversubscribes the cores,
and each team's kernels then wait at their barriers for a thread the other team descheduled
(engine/openmp.py has what else it costs). Under 16 streams on 2 cores, queries embedded on the
API's threads gave a time to first token p50 of 2.7-3.7 s, against 1.5-2.2 s between steps
(bench/serving.py).
"""

import asyncio
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.engine_protocol import Engine
from engine.factory import create_engine
from engine.openmp import release_thread_pool
from engine.request_output import RequestOutput
from engine.sampling import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
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

    def run_between_steps(self, fn: Callable[[], T],
                          meanwhile: Callable[[], object] | None = None) -> T:
        """Run `fn` on the engine thread before its next step and return what it returns (or
        raise what it raises); the calling thread waits, having first run `meanwhile` if given:
        work of its own that need not wait for `fn` (the API resolves a query's snapshot while
        the engine thread embeds the query). Should `meanwhile` raise, `fn` still runs and its
        result is dropped. Every call waiting when a step ends runs before the next one. Once
        the engine thread has stopped, `fn` runs here, after `meanwhile`."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            if meanwhile is not None:
                meanwhile()
            return fn()
        call: Future = Future()
        self._calls.put((fn, call))
        self._wake.set()
        if meanwhile is not None:
            meanwhile()
        while True:
            try:
                return call.result(timeout=1.0)
            except TimeoutError:
                # Still queued behind a long step, or left behind by a thread that has ended.
                if not self._thread.is_alive() and call.cancel():
                    return fn()

    def is_healthy(self) -> bool:
        """The step thread runs and the engine behind it (workers, in disaggregated mode) is up."""
        return self._thread.is_alive() and not self._stopping and self.engine.is_healthy()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    # -- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        # This thread and the OpenMP workers it starts yield the cores sooner to the API's
        # threads (EngineConfig.step_thread_nice); a thread's nice value is its own on Linux.
        # A sandbox that forbids it costs that latency, never the engine.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           self.engine.config.step_thread_nice)
        except OSError as error:
            log.warning("the step thread keeps its priority: %s", error)
        engine = self.engine
        while not self._stopping:
            self._run_calls()
            if not engine.has_unfinished_requests():
                if self._calls.empty():
                    # Idle: the team's workers would spin on for a few ms, slowing the API's
                    # threads on the same cores (a spinning thread on one vCPU slowed Python on
                    # the other 1.5x here): the retrieval and receipt commit that follow an
                    # embedding or a request's last step took 12 % longer (Zen 4 kind).
                    release_thread_pool()
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
        self._run_calls()  # the calls that came with the shutdown

    def _run_calls(self) -> None:
        for _ in range(self._calls.qsize()):  # the ones waiting now; later ones after a step
            fn, call = self._calls.get()
            if not call.set_running_or_notify_cancel():
                continue
            try:
                call.set_result(fn())
            except BaseException as error:  # the caller's to handle, on its own thread
                call.set_exception(error)

    def _deliver(self, outputs: list[tuple[str, RequestOutput | Exception]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, out in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, out in items:
        stream.put_nowait(out)
