"""Disaggregated prefill and decode: two worker processes behind the engine interface.

    engine = create_engine(EngineConfig(mode="disaggregated"))   # engine/factory.py, or
    engine = DisaggregatedEngine.from_config(EngineConfig(...), registry)

The front runs no model. Requests are validated, tokenized and queued by the same intake as the
colocated engine's (engine/intake.py), and text, stop strings, finish reasons, the per-request
timeline and the Prometheus metrics come from the same output processor
(engine/output_processor.py); its scheduler only tracks which requests wait and which run. Its
`step()` hands new requests to the prefill worker, forwards the messages between the workers
(engine/disagg_messages.py), and turns the token ids they report into RequestOutputs.
AsyncEngine drives it as it drives a colocated engine. The workers (engine/disagg_worker.py) each
run a colocated engine; their KV hand-off goes over torch.distributed (engine/kv_transfer.py).

One request: queued at the front -> prefilled (in chunks) by the prefill worker -> first token
reported; its KV stays in the prefill worker's blocks -> offered to the decode worker -> admitted
when its lifetime fits there -> "pull": the prefill worker's sender thread ships the blocks of
every layer while it prefills the next prompts -> scattered into the decode worker's blocks ->
decoded from the first token on. The transfer is a phase of the request's timeline
(`kv_transfer_time`, and `kv_transfer` with start, end and bytes).

Faults. The front watches both processes (their sentinels are in every wait) and their
heartbeats (engine/disagg_worker.py: the step loop stamps shared memory at every turn and every
decoder layer; a KV transfer marks its start). A worker that died, or that made no progress or sat
in one transfer for `disagg_heartbeat_timeout` seconds (SIGSTOP, a forward or a transfer that
never returns), is a fault: both workers are killed (the survivor's half of the process group is
dead), the requests that already streamed tokens fail with WorkerFailure, the ones that did not
are kept and re-run from the prompt, and both workers are started again on a fresh port:
`is_healthy()` is false from the moment of the fault until they are back (a fault while nothing
steps the engine is acted on at the next request). A worker that cannot start
`disagg_max_restarts + 1` times in a row leaves the engine dead: every request fails and new ones
are refused. The front sends to each worker on a thread of its own, so that a frozen worker that
stops reading its pipe cannot block the step loop.

Clocks: workers report the times of their steps on CLOCK_MONOTONIC (Python's perf_counter), which
all processes of one host share; workers on other hosts would need a clock offset, not done here.
"""

import contextlib
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import weakref
from multiprocessing import connection

import torch
import torch.multiprocessing as mp
from prometheus_client import CollectorRegistry, Gauge, Histogram

from engine import disagg_messages as wire
from engine import offline
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.disagg_worker import Heartbeat, WorkerSpec, worker_main
from engine.finish_reason import FinishReason
from engine.intake import RequestIntake
from engine.kv_transfer import transfer_backend
from engine.metrics import PREFIX, REQUEST_BUCKETS, EngineMetrics
from engine.model_runner import kv_cache_blocks
from engine.output_processor import OutputProcessor
from engine.request_output import RequestOutput
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.timeline import now

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
TOTALS = ("preemptions", "prefix_queries", "prefix_hits")  # WorkerStats' running totals
WAIT_S = 0.1  # longest a step waits for a worker when it has nothing else to do
STOP_GRACE_S = 2.0  # a stopping worker gets this long before it is killed


class WorkerFailure(RuntimeError):
    """A worker process died or failed: the requests it had streamed end with this error."""


class _Outbox:
    """Sends to one worker, in order, on a thread of its own: `conn.send` blocks once the
    worker stops reading (a frozen process) and its pipe fills, and the step loop must not."""

    def __init__(self, conn: connection.Connection, name: str):
        self._conn = conn
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, msg: wire.ToWorker) -> None:
        self._messages.put(msg)

    def close(self, timeout: float) -> None:
        """Send what is queued (within `timeout`: a worker just killed fails the send at once),
        then stop."""
        self._messages.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (msg := self._messages.get()) is not None:
            try:
                self._conn.send(msg)
            except Exception:  # a dead worker (or a closed pipe): _supervise finds it
                return


@dataclasses.dataclass(slots=True)
class _Worker:
    role: str
    process: mp.Process
    conn: connection.Connection
    outbox: _Outbox
    heartbeat: Heartbeat
    hello: wire.Hello | None = None
    fatal: str | None = None  # the traceback it sent before dying
    totals: wire.WorkerStats | None = None  # its last report's (running totals of its life)


def worker_specs(config: EngineConfig, model_path: str, num_blocks: int, port: int
                 ) -> dict[str, WorkerSpec]:
    """Each worker's settings: the front's, in colocated mode, on its own cores or GPU."""
    cuda = torch.device(config.device).type == "cuda"
    devices = {
        "prefill": config.disagg_prefill_device or ("cuda:0" if cuda else config.device),
        "decode": config.disagg_decode_device or (
            f"cuda:{min(1, torch.cuda.device_count() - 1)}" if cuda else config.device),
    }
    cpus = {"prefill": config.disagg_prefill_cpus, "decode": config.disagg_decode_cpus}
    if not cuda and (cpus["prefill"] is None or cpus["decode"] is None):
        mine = sorted(os.sched_getaffinity(0))
        half = max(1, len(mine) // 2)
        cpus = {"prefill": cpus["prefill"] or tuple(mine[:half]),
                "decode": cpus["decode"] or tuple(mine[half:] or mine[:half])}
    backend = transfer_backend(devices["prefill"], devices["decode"])
    blocks = {"prefill": config.disagg_prefill_kv_blocks or num_blocks,
              "decode": config.disagg_decode_kv_blocks or num_blocks}
    specs = {}
    for role in ROLES:
        worker_config = dataclasses.replace(
            config, mode="colocated", device=devices[role], num_kv_blocks=blocks[role],
            num_threads=len(cpus[role]) if cpus[role] else config.num_threads,
            # The front bounds the queue; nothing a worker holds is a prefix to share there.
            max_waiting_requests=1 << 30,
            enable_prefix_caching=config.enable_prefix_caching and role == "prefill",
        )
        specs[role] = WorkerSpec(role, worker_config, model_path, cpus[role],
                                 config.disagg_addr, port, backend)
    return specs


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _stop(workers: list[_Worker], graceful: bool = True) -> None:
    """Ask, then kill (at once when not `graceful`: after a fault the survivor's half of the
    process group is dead and its state is of no use)."""
    for w in workers:
        w.outbox.put(wire.Stop())
    deadline = time.monotonic() + (STOP_GRACE_S if graceful else 0.0)
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()  # also a stopped (SIGSTOP) one
            w.process.join(STOP_GRACE_S)
        w.outbox.close(STOP_GRACE_S)
        w.conn.close()


class DisaggregatedEngine:
    def __init__(self, config: EngineConfig, checkpoint, registry: CollectorRegistry | None = None):
        """`checkpoint`: the loaded model (engine.loader.Checkpoint); the front keeps its
        tokenizer and identity, the workers load the weights themselves."""
        num_blocks = kv_cache_blocks(config, checkpoint.config)
        decode_blocks = config.disagg_decode_kv_blocks or num_blocks
        registry = registry if registry is not None else CollectorRegistry()
        self.config = config
        self.tokenizer = checkpoint.tokenizer
        self.model_id = checkpoint.model_id
        self.weights_hash = checkpoint.weights_hash  # what receipts record
        # Requests are bounded by the decode worker's cache, which holds them to the end.
        self.intake = RequestIntake(config, self.tokenizer, checkpoint.config.vocab_size,
                                    decode_blocks)
        # Which requests wait and which run; the blocks are the workers'.
        self.scheduler = Scheduler(config, BlockManager(0, config.block_size, False))
        self.metrics = EngineMetrics(registry, self.model_id)
        self.output = OutputProcessor(config, self.tokenizer, self.scheduler, self.metrics,
                                      self.intake.requests)
        self.model_path = str(checkpoint.path)
        self._num_blocks = num_blocks
        self._location: dict[str, str] = {}  # request id -> the role that has it
        self._offers: set[str] = set()  # offered to the decode worker, not pulled nor declined
        self._orphans: set[str] = set()  # of those, finished here: their KV waits for a release
        self._ready: list[RequestOutput] = []  # outputs to return at the next step
        self._workers: dict[str, _Worker] = {}
        self._started_at = 0.0
        self._failed_starts = 0
        self.num_restarts = 0
        self._fault: tuple[list[str], WorkerFailure] | None = None
        self._dead: WorkerFailure | None = None
        self._totals = dict.fromkeys(TOTALS, 0)  # summed over the workers' lives
        self.worker_stats: dict[str, wire.WorkerStats] = {}  # each worker's last step report
        self._inspections: dict[str, wire.Inspection] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        labels = ["model_name"]
        self._kv_transfer_time = Histogram(
            PREFIX + "kv_transfer_time_seconds",
            "Disaggregated mode: pull of a request's KV blocks to KV usable by the decoder.",
            labels, buckets=REQUEST_BUCKETS, registry=registry).labels(self.model_id)
        self._prefill_kv_usage = Gauge(
            PREFIX + "prefill_kv_cache_usage_perc",
            "Disaggregated mode: fraction of the prefill worker's KV blocks in use (0-1).",
            labels, registry=registry).labels(self.model_id)
        self._finalizer = weakref.finalize(self, _stop, [])
        self._start_workers()

    @classmethod
    def from_config(cls, config: EngineConfig, registry: CollectorRegistry | None = None
                    ) -> "DisaggregatedEngine":
        """Load the model named by the config, start both workers, return once they serve."""
        from engine.loader import load_checkpoint
        from engine.model_files import bundled_model_path

        checkpoint = load_checkpoint(config.model or bundled_model_path())
        checkpoint.weights = {}  # the front needs the tokenizer and the identity only
        engine = cls(config, checkpoint, registry)
        try:
            engine.wait_until_ready()
        except BaseException:
            engine.close()
            raise
        return engine

    # -- life cycle -----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        port = self.config.disagg_port or free_port(self.config.disagg_addr)
        specs = worker_specs(self.config, self.model_path, self._num_blocks, port)
        ctx = mp.get_context(self.config.disagg_start_method)
        if self.config.disagg_start_method == "forkserver":  # import torch once, there
            ctx.set_forkserver_preload(["engine.disagg_worker"])
        self._workers = {}
        for role in ROLES:
            ours, theirs = ctx.Pipe()
            heartbeat = Heartbeat(ctx)
            process = ctx.Process(target=worker_main, args=(specs[role], theirs, heartbeat),
                                  name=f"inherent-{role}", daemon=True)
            process.start()
            theirs.close()
            self._workers[role] = _Worker(role, process, ours,
                                          _Outbox(ours, f"inherent-to-{role}"), heartbeat)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, list(self._workers.values()))
        self._started_at = now()
        log.info("disaggregated engine: workers starting on %s:%d (%s)", self.config.disagg_addr,
                 port, specs["prefill"].backend)

    @property
    def ready(self) -> bool:
        return bool(self._workers) and all(w.hello for w in self._workers.values())

    def is_healthy(self) -> bool:
        """Both workers up, serving, alive and making progress right now (from any thread)."""
        workers = list(self._workers.values())
        return (self._dead is None and self.ready
                and all(w.process.is_alive() for w in workers) and self._hung(workers) is None)

    def wait_until_ready(self) -> None:
        """Block until both workers serve; raise WorkerFailure if they cannot start. Call from
        the thread that steps the engine (or before anything steps it)."""
        while not self.ready:
            self._ready += self._receive(WAIT_S)
            try:
                self._supervise()
            except WorkerFailure:
                if self._dead is not None:
                    raise
                self._ready += self._fail(self._fault[0])  # restarting: fail what it streamed
                self._fault = None

    def worker_pids(self) -> dict[str, int]:
        return {role: w.process.pid for role, w in self._workers.items()}

    @property
    def worker_info(self) -> dict[str, wire.Hello | None]:
        """What each worker said when it started: pid, cores, threads, device, cache blocks."""
        return {role: w.hello for role, w in self._workers.items()}

    def close(self) -> None:
        """Stop both workers (the engine cannot serve after this)."""
        self._finalizer()
        self._workers = {}
        self._dead = self._dead or WorkerFailure("the engine is closed")
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- requests in ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self.intake.num_queued

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        if self._dead is not None:
            raise WorkerFailure(f"the disaggregated engine is down: {self._dead}")
        request_id = self.intake.add(prompt, params, request_id, arrival,
                                     self.scheduler.num_waiting)
        self._wake()
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.intake.abort(request_id)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"\0")

    def has_unfinished_requests(self) -> bool:
        """Also while an aborted request's KV waits in the prefill worker for the decode
        worker to decline its offer (the front forwards that release)."""
        return self.intake.has_unfinished() or bool(self._ready or self._orphans)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; one output per prompt, in order, with the whole
        text and all output token ids."""
        return offline.generate(self, prompts, params)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        outputs, self._ready = self._ready, []
        for seq in self.intake.drain(self.scheduler):  # tell the worker that has it
            self._drop(seq.request_id)
            outputs.append(self.output.finish(seq, FinishReason.ABORT))
        if self.ready:
            self._dispatch()
        outputs += self._receive(0.0 if outputs else WAIT_S)
        try:
            self._supervise()
        except WorkerFailure:
            self._ready = outputs  # delivered at the next step; the failed requests now
            raise
        self._observe_step(outputs)
        return outputs

    def fail_all(self) -> list[str]:
        """After `step()` raised: retire the requests the fault ended (all of them after an
        unexpected error, when the workers are restarted to start clean); their ids. Aborts
        wait for the next step."""
        self.intake.admit_new(self.scheduler)
        if self._fault is not None:
            failed, _ = self._fault
            self._fault = None
        else:
            failed = list(self.intake.requests)
            if self._dead is None:
                self._restart()
        if self._dead is not None:  # nothing will serve the rest either
            failed = list(dict.fromkeys([*failed, *self.intake.requests]))
        self._fail(failed)
        return failed

    def _fail(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            seq = self.intake.requests.get(request_id)
            if seq is not None and not seq.is_finished:
                self._drop(request_id)
                outputs.append(self.output.finish(seq, FinishReason.ABORT))
        return outputs

    def _dispatch(self) -> None:
        prefill = self._workers["prefill"]
        for seq in self.scheduler.waiting:
            if seq.request_id not in self._location:
                self._location[seq.request_id] = "prefill"
                self._send(prefill, wire.Add(seq.request_id,
                                             seq.token_ids[: seq.num_prompt_tokens],
                                             _wire_params(seq), seq.timeline.arrival))

    def _drop(self, request_id: str) -> None:
        """The front is done with a request the worker may still run: let it go."""
        role = self._location.pop(request_id, None)
        if role is not None and role in self._workers:
            self._send(self._workers[role], wire.Abort(request_id))
        if request_id in self._offers:
            self._orphans.add(request_id)

    def _send(self, worker: _Worker, msg: wire.ToWorker) -> None:
        worker.outbox.put(msg)

    # -- worker messages ------------------------------------------------------------------------

    def _receive(self, timeout: float) -> list[RequestOutput]:
        """Wait up to `timeout` for a worker (or a new request), then handle every message."""
        workers = list(self._workers.values())
        waitables = [self._wake_r]
        for w in workers:
            waitables += [w.conn, w.process.sentinel]
        connection.wait(waitables, timeout)
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass
        outputs: list[RequestOutput] = []
        for w in workers:
            try:
                while w.conn.poll():
                    self._on_message(w, w.conn.recv(), outputs)
            except (EOFError, OSError):
                pass  # it died: _supervise handles it
        return outputs

    def _on_message(self, worker: _Worker, msg: wire.ToFront, outputs: list[RequestOutput]) -> None:
        match msg:
            case wire.StepReport(stats, reports):
                self._on_stats(worker, stats)
                self._on_tokens(worker.role, reports, outputs)
            case wire.Pull(request_id) | wire.Release(request_id):
                # The prefill worker sends the KV, or frees it (Release: an offer the decode
                # worker dropped unpulled).
                self._answered(request_id)
                self._send(self._workers["prefill"], msg)
            case wire.Transferred(request_id, start, end, num_bytes):
                self._kv_transfer_time.observe(end - start)
                seq = self.intake.requests.get(request_id)
                if seq is not None:
                    seq.timeline.record_kv_transfer(start, end, num_bytes)
            case wire.Hello():
                worker.hello = msg
                if self.ready:
                    self._failed_starts = 0
                    log.info("disaggregated engine: workers ready %s", self.worker_info)
            case wire.Inspection():
                self._inspections[worker.role] = msg
            case wire.Fatal(trace):
                worker.fatal = trace
                log.error("disaggregated engine: the %s worker failed:\n%s", worker.role, trace)

    def _on_tokens(self, role: str, reports: list[wire.TokenReport],
                   outputs: list[RequestOutput]) -> None:
        for report in reports:
            request_id, worker_reason = report.request_id, report.finish_reason
            seq = self.intake.requests.get(request_id)
            if seq is None:  # finished here already (aborted, or a stop string)
                if report.prefill is not None and worker_reason is None:
                    self._send(self._workers["prefill"], wire.Release(request_id))
                continue
            if report.prefill is not None:
                self._start_decoding(seq, report.prefill)
            if report.logprobs is not None:
                seq.logprobs.append(report.logprobs)
            out = self.output.on_token(seq, report.token, report.at, report.interfered)
            outputs.append(out)
            if out.finished:
                if worker_reason is None and role == "decode":  # a stop string: text is ours
                    self._drop(request_id)
                elif worker_reason is None:  # ... on the first token: its KV is held
                    self._send(self._workers["prefill"], wire.Release(request_id))
                self._location.pop(request_id, None)
            elif worker_reason is not None:  # the same checks ran on both sides; never hang
                log.error("request %s: the %s worker finished it (%s), the front did not",
                          request_id, role, worker_reason)
                self._location.pop(request_id, None)
                outputs.append(self.output.finish(seq, worker_reason))
            elif report.prefill is not None:  # its KV waits in the prefill worker: offer it
                self._location[request_id] = "decode"
                self._offers.add(request_id)
                self._send(self._workers["decode"], wire.Offer(
                    request_id, list(seq.token_ids), seq.num_prompt_tokens, _wire_params(seq),
                    report.at))

    def _answered(self, request_id: str) -> None:
        self._offers.discard(request_id)
        self._orphans.discard(request_id)

    def _start_decoding(self, seq: Sequence, prefill: wire.PrefillFacts) -> None:
        """Its first token came: the prefill facts join the front's timeline."""
        timeline = seq.timeline
        timeline.first_scheduled = prefill.first_scheduled
        timeline.prefill_chunks = list(prefill.chunks)
        timeline.num_cached_tokens = prefill.num_cached_tokens
        timeline.num_preemptions = prefill.num_preemptions
        self.scheduler.start_decoding(seq)

    def _on_stats(self, worker: _Worker, stats: wire.WorkerStats) -> None:
        for key in TOTALS:  # running totals per worker life, summed across restarts
            last = getattr(worker.totals, key) if worker.totals is not None else 0
            self._totals[key] += getattr(stats, key) - last
        worker.totals = stats
        self.worker_stats[worker.role] = stats
        if worker.role == "decode" and stats.clean_step is not None:
            self.output.record_clean_decode_step(stats.clean_step)

    def _observe_step(self, outputs: list[RequestOutput]) -> None:
        def usage(role: str) -> float:
            stats = self.worker_stats.get(role)
            return stats.kv_usage if stats is not None else 0.0

        self._prefill_kv_usage.set(usage("prefill"))
        self.metrics.observe_step(
            self.scheduler.num_running, self.scheduler.num_waiting, usage("decode"),
            sum(len(o.token_ids) for o in outputs), self._totals["preemptions"],
            self._totals["prefix_queries"], self._totals["prefix_hits"],
        )

    # -- faults ---------------------------------------------------------------------------------

    def _supervise(self) -> None:
        """When a worker died or cannot start: restart both, and raise WorkerFailure for
        the requests that streamed tokens (`fail_all` retires them)."""
        dead = [w for w in self._workers.values() if not w.process.is_alive()]
        hung = None if dead else self._hung(list(self._workers.values()))
        starting = not self.ready
        timed_out = starting and now() - self._started_at > self.config.disagg_start_timeout
        if not dead and not hung and not timed_out:
            return
        if dead:
            w = dead[0]
            what = (f"the {w.role} worker (pid {w.process.pid}) "
                    f"{'could not start' if w.hello is None else 'died'} "
                    f"(exit code {w.process.exitcode})")
            if w.fatal:
                what += ": " + w.fatal.strip().splitlines()[-1]
        elif hung:
            w, silence = hung
            what = (f"the {w.role} worker (pid {w.process.pid}) hung: {silence} (limit "
                    f"disagg_heartbeat_timeout = {self.config.disagg_heartbeat_timeout:g} s); "
                    f"killed")
        else:
            what = f"the workers did not start within {self.config.disagg_start_timeout:.0f} s"
        if starting:
            self._failed_starts += 1
        if self._failed_starts > self.config.disagg_max_restarts:
            self._dead = WorkerFailure(
                f"disaggregated engine: {what}; gave up after {self._failed_starts} failed "
                f"starts in a row")
            _stop(list(self._workers.values()), graceful=False)
            self._workers = {}
            self._fault = (list(self.intake.requests), self._dead)
            raise self._dead
        # Requests that streamed nothing re-run from the prompt on the new workers.
        failed = [rid for rid, seq in self.intake.requests.items() if seq.num_output_tokens]
        log.error("disaggregated engine: %s; %d requests failed, %d will re-run", what,
                  len(failed), len(self.intake.requests) - len(failed))
        self._restart()
        if failed:
            error = WorkerFailure(f"disaggregated engine: {what}; the request was lost with "
                                  f"it and the engine is restarting its workers")
            self._fault = (failed, error)
            raise error

    def _hung(self, workers: list[_Worker]) -> tuple[_Worker, str] | None:
        """A serving worker whose heartbeat is older than the limit, and how long it has been
        silent. A frozen loop goes first: a transfer also stalls when its peer is frozen."""
        limit = self.config.disagg_heartbeat_timeout
        silences = [(w, *w.heartbeat.silence()) for w in workers if w.hello is not None]
        for w, loop, _ in silences:
            if loop > limit:
                return w, f"its step loop made no progress for {loop:.1f} s"
        for w, _, transfer in silences:
            if transfer > limit:
                return w, f"a KV transfer has been running for {transfer:.1f} s"
        return None

    def _restart(self) -> None:
        _stop(list(self._workers.values()), graceful=False)
        self._location.clear()  # what streamed nothing is dispatched again
        self._offers.clear()
        self._orphans.clear()
        self.num_restarts += 1
        log.warning("disaggregated engine: restarting its workers (restart %d)",
                    self.num_restarts)
        self._start_workers()

    # -- inspection -----------------------------------------------------------------------------

    def inspect(self, timeout: float = 10.0) -> dict[str, wire.Inspection]:
        """Each worker's block and request counts, asked now. Call from the thread that steps
        the engine (or while nothing steps it); outputs that arrive meanwhile are kept for the
        next step."""
        self._inspections = {}
        for w in self._workers.values():
            self._send(w, wire.Inspect())
        deadline = now() + timeout
        while len(self._inspections) < len(self._workers):
            if now() > deadline:
                raise TimeoutError(f"workers did not answer in {timeout} s")
            self._ready += self._receive(min(WAIT_S, max(0.0, deadline - now())))
        return dict(self._inspections)


def _wire_params(seq: Sequence):
    """The request's sampling settings with the seed the front derived, so that every worker
    samples as a colocated engine would."""
    return dataclasses.replace(seq.params, seed=seq.seed)
